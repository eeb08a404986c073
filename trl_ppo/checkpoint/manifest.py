"""A checkpoint's manifest: every file's size and SHA-256, written last, so that a checkpoint proves it is whole.

`checkpoint_problem` reads it before anything is loaded: a file deleted, truncated or changed after the save is
found and named, instead of surfacing as a library error deep inside loading (or, worse, as a silent default:
a missing `config.json` made transformers build its default config, a missing `scheduler.pt` restarted the
learning-rate schedule)."""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
_CHUNK = 8 * 1024 * 1024  # hashing reads this much at a time: memory stays bounded whatever the file size


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_files(folder: str) -> list[str]:
    """The files under `folder` as sorted relative POSIX paths, the manifest itself excepted."""
    found = []
    for root, _, names in os.walk(folder):
        for name in names:
            relative = os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
            if relative != MANIFEST_NAME:
                found.append(relative)
    return sorted(found)


def _digests(folder: str, files: list[str]) -> list[str]:
    # hashlib releases the GIL on large buffers, so threads hash several files at once.
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda name: sha256_of(os.path.join(folder, name)), files))


def manifest_entries(folder: str) -> dict[str, dict]:
    """{relative path: {"size": bytes, "sha256": hex digest}} for every file under `folder`."""
    files = checkpoint_files(folder)
    sizes = [os.path.getsize(os.path.join(folder, name)) for name in files]
    return {name: {"size": size, "sha256": digest} for name, size, digest in zip(files, sizes, _digests(folder, files))}


def manifest_of(folder: str) -> dict:
    """The manifest of everything now in `folder`, JSON-ready (written as `MANIFEST_NAME`, last)."""
    return {"format": MANIFEST_FORMAT, "algorithm": "sha256", "files": manifest_entries(folder)}


def read_manifest(folder: str) -> dict[str, dict]:
    """The manifest's file entries; raises `ValueError` naming the manifest if it is missing or unreadable."""
    path = os.path.join(folder, MANIFEST_NAME)
    if not os.path.isfile(path):
        raise ValueError(f"{path} is missing")
    try:
        with open(path, encoding="utf-8") as handle:
            manifest = json.load(handle)
        files = manifest["files"]
        if manifest.get("algorithm") != "sha256" or not isinstance(files, dict):
            raise ValueError("not a trl_ppo manifest")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is damaged ({error})") from None
    if not files:  # every checkpoint has files: an empty list would verify anything
        raise ValueError(f"{path} is damaged: it lists no files")
    for name, entry in files.items():  # a hand-edited manifest: name the entry rather than fail on it later
        if not (isinstance(entry, dict) and type(entry.get("size")) is int and isinstance(entry.get("sha256"), str)):
            raise ValueError(
                f"{path} is damaged: its entry for {name!r} ({entry!r}) needs an integer `size` and a `sha256` string"
            )
    return files


def checkpoint_problem(folder: str) -> str | None:
    """What is wrong with checkpoint `folder` (the first file found missing, truncated or changed), or None if
    every file matches its manifest entry. Sizes are checked for every file before any is hashed. Files the
    manifest does not list (a note a user left, a file system's own) are not checked."""
    try:
        expected = read_manifest(folder)
    except ValueError as error:
        return str(error)
    for name, entry in expected.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"{path} is missing"
        size = os.path.getsize(path)
        if size != entry["size"]:
            return f"{path} has {size} bytes where {entry['size']} were written (truncated or overwritten)"
    names = list(expected)
    for name, digest in zip(names, _digests(folder, names)):
        if digest != expected[name]["sha256"]:
            return f"{os.path.join(folder, name)} does not match its SHA-256 in the manifest (changed after the save)"
    return None


def unreadable_weights(folder: str) -> str | None:
    """The first `*.safetensors` file under `folder` whose header does not match its size (truncated, or not
    safetensors), as a problem line; or None. What can be checked of a checkpoint without a manifest."""
    from safetensors import safe_open

    for name in checkpoint_files(folder):
        if name.endswith(".safetensors"):
            path = os.path.join(folder, name)
            try:
                with safe_open(path, framework="pt") as handle:
                    handle.keys()
            except Exception as error:  # SafetensorError, and an OSError of an unreadable file
                return f"{path} cannot be read ({type(error).__name__}: {error}): it is truncated or damaged"
    return None

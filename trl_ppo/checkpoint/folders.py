"""Checkpoint folders on disk: their names, atomic publication (written under `tmp-checkpoint-<update>`, renamed
to `checkpoint-<update>` only when complete, so a folder named `checkpoint-*` is always whole), rotation, and
which one a run resumes from."""

from __future__ import annotations

import json
import os
import re
import shutil

PPO_STATE_NAME = "trl_ppo_state.json"
CHECKPOINT_PREFIX = "checkpoint-"
STAGING_PREFIX = "tmp-checkpoint-"


def write_json(path: str, data: dict) -> None:
    """Write JSON through a temporary file and a rename, flushed to disk."""
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def checkpoint_step(path: str) -> int | None:
    match = re.fullmatch(rf"{CHECKPOINT_PREFIX}(\d+)", os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def complete_checkpoints(output_dir: str) -> list[str]:
    """The complete checkpoints in `output_dir`, oldest update first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        path = os.path.join(output_dir, name)
        if checkpoint_step(name) is not None and os.path.isfile(os.path.join(path, PPO_STATE_NAME)):
            found.append(path)
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(output_dir: str) -> str | None:
    checkpoints = complete_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


def staging_folder(output_dir: str, step: int) -> str:
    """A fresh, empty folder to write checkpoint `step` into (left-overs of an interrupted save removed)."""
    path = os.path.join(output_dir, f"{STAGING_PREFIX}{step}")
    shutil.rmtree(path, ignore_errors=True)
    return path


def publish_checkpoint(staging: str, output_dir: str, step: int) -> str:
    """Move a completely written staging folder to `checkpoint-<step>`, replacing an older one of that name."""
    final = os.path.join(output_dir, f"{CHECKPOINT_PREFIX}{step}")
    if os.path.exists(final):
        retired = final + ".replaced"
        shutil.rmtree(retired, ignore_errors=True)
        os.replace(final, retired)
        os.replace(staging, final)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(staging, final)
    return final


def rotate_checkpoints(output_dir: str, save_total_limit: int | None, keep: str) -> None:
    """Delete the oldest complete checkpoints beyond `save_total_limit`, never `keep` (the newest one)."""
    if not save_total_limit or save_total_limit <= 0:
        return
    checkpoints = [path for path in complete_checkpoints(output_dir) if os.path.abspath(path) != os.path.abspath(keep)]
    for path in checkpoints[: max(0, len(checkpoints) - (save_total_limit - 1))]:
        shutil.rmtree(path, ignore_errors=True)


def checkpoint_to_resume(output_dir: str, resume_from_checkpoint: str | bool | None) -> str | None:
    """The checkpoint folder to resume from (None for a fresh run), refusing to overwrite an earlier run:
    `resume_from_checkpoint` is a folder, True / "true" / "latest" for the newest complete one in `output_dir`,
    or None / False for a fresh run (then `output_dir` must hold no checkpoint)."""
    if resume_from_checkpoint in (None, False):
        existing = latest_checkpoint(output_dir)
        if existing is not None:
            raise ValueError(
                f"`output_dir` ({output_dir}) already holds checkpoints of a run (latest: {existing}). Resume it "
                "with `train(resume_from_checkpoint=True)` (`--resume_from_checkpoint latest`), or start a new "
                "run in another `output_dir`."
            )
        return None
    if resume_from_checkpoint is True or str(resume_from_checkpoint).lower() in ("true", "latest"):
        path = latest_checkpoint(output_dir)
        if path is None:
            raise ValueError(f"`resume_from_checkpoint=True`: no complete checkpoint in `output_dir` ({output_dir}).")
        return path
    path = str(resume_from_checkpoint)
    if not os.path.isfile(os.path.join(path, PPO_STATE_NAME)):
        raise ValueError(
            f"`resume_from_checkpoint` ({path}) is not a complete trl_ppo checkpoint (no {PPO_STATE_NAME})."
        )
    return path

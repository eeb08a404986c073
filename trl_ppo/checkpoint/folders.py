"""Checkpoint folders on disk: their names, atomic publication (written under `tmp-checkpoint-<update>-<run>`, renamed
to `checkpoint-<update>` only when complete), rotation, the removal of what an interrupted save left behind, which
checkpoint a run resumes from (the newest one whose files match its manifest, `manifest.py`), and the newer
checkpoints a resume from an older one sets aside (`checkpoint-<update>.abandoned-<time>`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import time

from transformers.utils import logging

from .manifest import MANIFEST_NAME, checkpoint_problem, unreadable_weights

logger = logging.get_logger(__name__)

PPO_STATE_NAME = "trl_ppo_state.json"
CHECKPOINT_PREFIX = "checkpoint-"
STAGING_PREFIX = "tmp-checkpoint-"
ABANDONED_MARK = ".abandoned-"
RETIRED_MARK = ".replaced"  # a folder renamed before it is deleted, so that a kill never leaves it half-deleted
AUTO = "auto"  # `resume_from_checkpoint="auto"`: resume when there is a checkpoint, else start (veRL's resume_mode)


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


def read_json(path: str) -> dict:
    """A checkpoint's JSON file (each holds an object); a missing, damaged or other one raises `ValueError`
    naming it."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError) as error:
        raise ValueError(f"{path} cannot be read ({type(error).__name__}: {error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object (it holds {type(data).__name__}): it is damaged.")
    return data


def checkpoint_folders(output_dir: str) -> list[str]:
    """Every `checkpoint-<update>` folder in `output_dir`, whole or not, oldest update first."""
    if not os.path.isdir(output_dir):
        return []
    found = [os.path.join(output_dir, name) for name in os.listdir(output_dir) if checkpoint_step(name) is not None]
    return sorted((path for path in found if os.path.isdir(path)), key=checkpoint_step)


def complete_checkpoints(output_dir: str) -> list[str]:
    """The checkpoints in `output_dir` whose save finished (a manifest, or the run state of a checkpoint written
    before manifests), oldest update first. Their files are not verified here: see `verified_problem`."""
    markers = (MANIFEST_NAME, PPO_STATE_NAME)
    return [
        path for path in checkpoint_folders(output_dir) if any(os.path.isfile(os.path.join(path, m)) for m in markers)
    ]


def latest_checkpoint(output_dir: str) -> str | None:
    checkpoints = complete_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


def written_before_manifests(path: str) -> bool:
    """A checkpoint of an older trl_ppo: no manifest, and a run state that does not say one was written."""
    if os.path.isfile(os.path.join(path, MANIFEST_NAME)):
        return False
    try:
        return "manifest" not in read_json(os.path.join(path, PPO_STATE_NAME))
    except ValueError:
        return False


def verified_problem(path: str) -> str | None:
    """What makes checkpoint `path` unusable (`manifest.checkpoint_problem`), or None if it verifies. One
    written before manifests cannot be verified: it is used, with a warning, if its weights files read whole. The
    verdict is kept for this process while no file of the folder changes name, size or modification time: the
    CLI's early check and `train()`'s then hash a large checkpoint once, not twice."""
    if written_before_manifests(path):  # only its weights files' headers can be checked
        logger.warning(f"{path} was written by a trl_ppo without checkpoint manifests: its files are not verified.")
        return unreadable_weights(path)
    key, fingerprint = os.path.realpath(path), folder_fingerprint(path)
    if _VERDICTS.get(key, (None,))[0] != fingerprint:
        _VERDICTS[key] = (fingerprint, checkpoint_problem(path))
    return _VERDICTS[key][1]


_VERDICTS: dict[str, tuple[tuple, str | None]] = {}  # real path -> (fingerprint, problem)


def folder_fingerprint(path: str) -> tuple:
    """(relative path, size, mtime in ns) of every file under `path`, sorted."""
    entries = []
    for root, _, files in os.walk(path):
        for name in files:
            stat = os.stat(os.path.join(root, name))
            entries.append((os.path.relpath(os.path.join(root, name), path), stat.st_size, stat.st_mtime_ns))
    return tuple(sorted(entries))


def remove_unfinished_saves(output_dir: str) -> list[str]:
    """Delete what interrupted saves left in `output_dir` (`tmp-checkpoint-*`, `checkpoint-*.replaced`), with a
    warning that names them -> their paths."""
    if not os.path.isdir(output_dir):
        return []
    names = sorted(n for n in os.listdir(output_dir) if n.startswith(STAGING_PREFIX) or n.endswith(RETIRED_MARK))
    removed = [os.path.join(output_dir, name) for name in names if os.path.isdir(os.path.join(output_dir, name))]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    if removed:
        logger.warning(f"Removed {len(removed)} unfinished checkpoint folder(s) of an interrupted save: {removed}")
    return removed


def put_back_retired_checkpoints(output_dir: str) -> list[str]:
    """Rename each `checkpoint-<n>.replaced` that verifies whole, where no `checkpoint-<n>` exists, back to its name
    (a kill came between setting it aside and its replacement's move, or before a rotation deleted it), with a
    warning -> the paths put back. Called by the run that holds `output_dir`'s lock, before it chooses a
    checkpoint: an interrupted save never loses one."""
    if not os.path.isdir(output_dir):
        return []
    restored = []
    for name in sorted(os.listdir(output_dir)):
        path = os.path.join(output_dir, name)
        original = path[: -len(RETIRED_MARK)]
        if not name.endswith(RETIRED_MARK) or checkpoint_step(original) is None or os.path.exists(original):
            continue
        if os.path.isdir(path) and checkpoint_problem(path) is None:
            os.replace(path, original)
            restored.append(original)
    if restored:
        logger.warning(f"Put back checkpoint(s) that an interrupted save had set aside: {restored}")
    return restored


def staging_folder(output_dir: str, step: int, run_id: str | None = None, clear: bool = True) -> str:
    """The folder to write checkpoint `step` of run `run_id` into: `tmp-checkpoint-<step>-<run id>`, each run's
    own, so that no run writes into another's save; with `clear` (the main process), emptied of what an
    interrupted save of this run left behind."""
    path = os.path.join(output_dir, f"{STAGING_PREFIX}{step}" + (f"-{run_id}" if run_id else ""))
    if clear:
        shutil.rmtree(path, ignore_errors=True)
    return path


def publish_checkpoint(staging: str, output_dir: str, step: int) -> str:
    """Move a completely written staging folder to `checkpoint-<step>`, replacing an older one of that name."""
    final = os.path.join(output_dir, f"{CHECKPOINT_PREFIX}{step}")
    if os.path.exists(final):
        replace_folder(staging, final)
    else:
        os.replace(staging, final)
    return final


def replace_folder(source: str, target: str) -> None:
    """Put the folder `source` in place of the existing `target`: `target` is set aside first (`os.replace` cannot
    replace a non-empty folder), then removed once `source` stands in its place."""
    retired = target + RETIRED_MARK
    shutil.rmtree(retired, ignore_errors=True)
    os.replace(target, retired)
    os.replace(source, target)
    shutil.rmtree(retired, ignore_errors=True)


def rotate_checkpoints(output_dir: str, save_total_limit: int | None, keep: str) -> None:
    """Delete the oldest complete checkpoints beyond `save_total_limit`, never `keep` (the newest one). Each is
    renamed first (`RETIRED_MARK`): a kill while it is deleted leaves no half-deleted `checkpoint-<n>`."""
    if not save_total_limit or save_total_limit <= 0:
        return
    checkpoints = [path for path in complete_checkpoints(output_dir) if os.path.abspath(path) != os.path.abspath(keep)]
    for path in checkpoints[: max(0, len(checkpoints) - (save_total_limit - 1))]:
        shutil.rmtree(path + RETIRED_MARK, ignore_errors=True)
        os.replace(path, path + RETIRED_MARK)
        shutil.rmtree(path + RETIRED_MARK, ignore_errors=True)


def set_aside_newer_checkpoints(output_dir: str, resumed: str) -> list[str]:
    """Rename each checkpoint folder in `output_dir` of a later update than `resumed` (the branch a resume from
    an older checkpoint abandons) to `checkpoint-<update>.abandoned-<UTC time>`, with a warning naming them, so
    that `latest`, rotation and the resumed run's own saves of those updates never take or replace them; nothing
    is deleted -> their new paths."""
    step = resumed_update(resumed)
    newer = [path for path in checkpoint_folders(output_dir) if step is not None and checkpoint_step(path) > step]
    stamp, moved = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()), []
    for path in newer:
        target, count = f"{path}{ABANDONED_MARK}{stamp}", 1
        while os.path.exists(target):
            count += 1
            target = f"{path}{ABANDONED_MARK}{stamp}-{count}"
        os.replace(path, target)
        moved.append(target)
    if moved:
        logger.warning(
            f"Resuming from {resumed}, an older checkpoint than {len(moved)} in `output_dir`: set aside the newer "
            f"ones (the branch this resume abandons), renamed, nothing deleted: {moved}. `latest` and "
            "`save_total_limit` no longer see them; delete them yourself once they are not needed."
        )
    return moved


def resumed_update(path: str) -> int | None:
    """The update of checkpoint `path`: from its name, or (a folder renamed by its user) its trainer state."""
    step = checkpoint_step(path)
    if step is None:
        try:
            step = int(read_json(os.path.join(path, "trainer_state.json"))["global_step"])
        except (ValueError, KeyError, TypeError):
            return None
    return step


def is_auto(resume_from_checkpoint) -> bool:
    """Whether `resume_from_checkpoint` is "auto" (in any case)."""
    return isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.lower() == AUTO


def checkpoint_to_resume(
    output_dir: str, resume_from_checkpoint: str | bool | None, overwrite: bool = False
) -> str | None:
    """The checkpoint folder to resume from (None for a fresh run), refusing to overwrite an earlier run:
    `resume_from_checkpoint` is a folder (refused, naming the file, unless it verifies), True / "true" /
    "latest" for the newest one in `output_dir` that verifies (the ones skipped are named, with the reason),
    "auto" for the same when `output_dir` holds a checkpoint folder and a fresh run when it holds none (a job a
    cluster requeues with the same command, killed before its first checkpoint; a folder of only damaged
    checkpoints is refused, never started over), or None / False for a fresh run: then `output_dir` must hold no
    checkpoint folder, or with `overwrite` (the config's `overwrite_output_dir`) the ones it holds are deleted."""
    if is_auto(resume_from_checkpoint):
        return newest_verified_checkpoint(output_dir, AUTO) if checkpoint_folders(output_dir) else None
    if resume_from_checkpoint in (None, False):
        existing = checkpoint_folders(output_dir)
        if existing and overwrite:
            for path in existing:
                shutil.rmtree(path)
            logger.warning(f"`overwrite_output_dir=True`: deleted the earlier run's checkpoints {existing}.")
        elif existing:
            raise ValueError(
                f"`output_dir` ({output_dir}) already holds checkpoints of {earlier_run(existing[-1])}. Resume it with "
                "`train(resume_from_checkpoint=True)` (`--resume_from_checkpoint latest`; `load_checkpoint()` for a "
                "run driven by `step()`), start afresh deleting them with `overwrite_output_dir=True` "
                "(`--overwrite_output_dir`), or start a new run in another `output_dir`."
            )
        return None
    if resume_from_checkpoint is True or str(resume_from_checkpoint).lower() in ("true", "latest"):
        return newest_verified_checkpoint(output_dir, resume_from_checkpoint)
    path = str(resume_from_checkpoint)
    if not os.path.isdir(path):
        raise ValueError(f"`resume_from_checkpoint` ({path}) is not a folder.")
    problem = verified_problem(path)
    if problem is not None:
        raise ValueError(
            f"`resume_from_checkpoint` ({path}) is not a whole trl_ppo checkpoint: {problem}. Nothing was loaded; "
            "`resume_from_checkpoint=True` takes the newest checkpoint in `output_dir` that verifies."
        )
    return path


def earlier_run(latest: str) -> str:
    """The run whose newest checkpoint is `latest`, in words: finished, or stopped after update k of n."""
    try:
        state = read_json(os.path.join(latest, "trainer_state.json"))
        done, total = int(state["global_step"]), int(state["max_steps"])
    except (ValueError, KeyError, TypeError):
        return f"a run (latest: {latest})"
    if total and done >= total:
        return f"a finished run (latest: {latest}, update {done} of {total})"
    return f"an unfinished run (latest: {latest}, stopped after update {done} of {total})"


def newest_verified_checkpoint(output_dir: str, requested: str | bool = True) -> str:
    """The newest checkpoint folder in `output_dir` whose files match its manifest; each newer one skipped is
    named in a warning with its problem. `requested`: the value that asked for it (True, "latest"), for errors."""
    skipped = []
    for path in reversed(checkpoint_folders(output_dir)):
        problem = verified_problem(path)
        if problem is None:
            if skipped:
                logger.warning(f"Resuming from {path}; skipped newer checkpoint(s) that do not verify: {skipped}")
            return path
        skipped.append(f"{os.path.basename(path)}: {problem}")
    if skipped:
        raise ValueError(f"`resume_from_checkpoint={requested!r}`: no checkpoint in {output_dir} verifies: {skipped}")
    raise ValueError(
        f"`resume_from_checkpoint={requested!r}`: no complete checkpoint in `output_dir` ({output_dir}), so nothing "
        "to resume; leave `resume_from_checkpoint` out to start a new run there."
    )

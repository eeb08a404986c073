"""One run at a time in an `output_dir`: the run lock, taken before a run writes anything there.

Two runs started at the same moment in one folder would both pass the start checks (`ownership.py`) before either
has saved, then write over each other's checkpoints. So a run first takes `output_dir/.trl_ppo_run.lock`: an
exclusive `flock` on that file, held by the process for the run (`train()` releases it at its end; a run driven
by `step()` holds it until its process exits). The kernel drops the lock of a process that dies, so the lock of a
crashed run is stale at once and taken over; the file only says who holds it (process id, host, run id, start),
for the refusal's message. Within one process the lock is re-entrant: a second trainer there meets the
ownership checks instead. Where `fcntl` does not exist (Windows) no lock is taken.
"""

from __future__ import annotations

import json
import os
import socket
import time

from .ownership import CheckpointOfAnotherRunError

try:
    import fcntl
except ImportError:  # Windows: no run lock, the ownership checks alone
    fcntl = None

LOCK_NAME = ".trl_ppo_run.lock"

_HELD: dict[str, int] = {}  # real path of the lock file -> its open descriptor, in this process


def lock_path(output_dir: str) -> str:
    return os.path.realpath(os.path.join(output_dir, LOCK_NAME))


def holds_run_lock(output_dir: str) -> bool:
    return lock_path(output_dir) in _HELD


def take_run_lock(output_dir: str, run_id: str | None = None) -> bool:
    """Take the run lock of `output_dir` (created if needed) -> whether this call took it (False: this process
    held it already). Raises `CheckpointOfAnotherRunError` naming the run holding it."""
    path = lock_path(output_dir)
    if path in _HELD or fcntl is None:
        return False
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for _ in range(20):  # a holder releasing it meanwhile unlinks the file: open it again
        handle = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(handle)
            raise in_use_error(output_dir, read_holder(path)) from None
        if os.path.exists(path) and os.stat(path).st_ino == os.fstat(handle).st_ino:
            break
        os.close(handle)  # locked a file its holder had just removed
    else:
        raise in_use_error(output_dir, read_holder(path))
    _HELD[path] = handle
    describe_holder(output_dir, run_id)
    return True


def describe_holder(output_dir: str, run_id: str | None) -> None:
    """Write who holds the lock into its file (read only for messages)."""
    handle = _HELD.get(lock_path(output_dir))
    if handle is None:
        return
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "run_id": run_id, "since": time.time()}
    os.ftruncate(handle, 0)
    os.pwrite(handle, json.dumps(holder).encode(), 0)


def release_run_lock(output_dir: str) -> None:
    """Release the run lock of `output_dir` if this process holds it, removing its file."""
    path = lock_path(output_dir)
    handle = _HELD.pop(path, None)
    if handle is None:
        return
    try:
        os.unlink(path)  # first: no one takes a file on its way out
    except OSError:
        pass
    os.close(handle)  # drops the lock


def read_holder(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            holder = json.load(handle)
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}


def in_use_error(output_dir: str, holder: dict) -> CheckpointOfAnotherRunError:
    """The refusal of a run whose `output_dir` another live process holds the run lock of."""
    since = holder.get("since")
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(since)) if isinstance(since, float) else "?"
    run = holder.get("run_id") or "?"
    who = f"process {holder.get('pid', '?')} on {holder.get('host', '?')} (run {run}, since {started})"
    return CheckpointOfAnotherRunError(
        f"`output_dir` ({output_dir}) is in use by another run: {who} holds its run lock "
        f"{os.path.join(output_dir, LOCK_NAME)}. Nothing was written. Two runs in one folder would write over "
        "each other's checkpoints: give this run its own `output_dir`, or wait until that run has ended (the "
        "lock of a process that has ended is taken over by itself)."
    )

"""Which run a checkpoint belongs to, so that no run replaces, or writes beside, the checkpoints of another.

Every fresh run gets a run id (`new_run_id`: when it started, and random digits), kept in its `RunState` and so
in every checkpoint it writes (`trl_ppo_state.json`); a resumed run keeps the id of the checkpoint it resumed
from. A run may write into `output_dir` only while every checkpoint there is its own: checked when the run
starts (`run_to_continue`) and again just before each checkpoint is renamed into place
(`refuse_checkpoints_of_other_runs`), which catches two runs started in one folder before either saved.
Checkpoints of an older trl_ppo, written before run ids, belong to a run of the same identity (`identity.py`).
"""

from __future__ import annotations

import os
import secrets
import time

from .folders import PPO_STATE_NAME, checkpoint_folders, read_json
from .identity import identity_differences


class CheckpointOfAnotherRunError(ValueError):
    """`output_dir` holds checkpoints of another run: writing there would replace them, or mix two runs (a resume
    would then take the newest of either). The other run's checkpoints are kept."""


def new_run_id() -> str:
    """A fresh run's id: its start (UTC) and 8 random hex digits (from the OS: the seeded RNGs are untouched)."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(4)


def recorded_run(path: str) -> tuple[str | None, dict] | None:
    """(run id, identity) recorded in checkpoint `path` (run id None: written before run ids), or None when its
    run state cannot be read."""
    try:
        state = read_json(os.path.join(path, PPO_STATE_NAME))
    except ValueError:
        return None
    identity = state.get("identity")
    return state.get("run_id"), identity if isinstance(identity, dict) else {}


def checkpoints_of_other_runs(output_dir: str, run_id: str, identity: dict) -> list[str]:
    """Each checkpoint in `output_dir` that another run wrote, as `"<path> (run <id>)"`. One whose run state
    cannot be read is not counted: it cannot be resumed, and only a resumed run meets it (a fresh run refuses any
    checkpoint), after being warned that it skipped it; it is then replaced, as before run ids."""
    found = []
    for path in checkpoint_folders(output_dir):
        recorded = recorded_run(path)
        if recorded is None:
            continue
        their_id, their_identity = recorded
        if their_id is None:  # an older trl_ppo's: the same identity is the same run
            if identity_differences(their_identity, identity):
                found.append(f"{path} (a run of other settings or models, written before run ids)")
        elif their_id != run_id:
            found.append(f"{path} (run {their_id})")
    return found


def run_to_continue(output_dir: str, checkpoint: str | None, identity: dict) -> str:
    """The run id of a run starting in `output_dir`, resumed from `checkpoint` (its id) or fresh (a new one);
    refuses, before any compute, an `output_dir` holding checkpoints of another run, and a `checkpoint` whose run
    state does not read (`ValueError` naming the file)."""
    run_id = None
    if checkpoint is not None:
        run_id = read_json(os.path.join(checkpoint, PPO_STATE_NAME)).get("run_id")  # None: before run ids
    run_id = run_id or new_run_id()
    others = checkpoints_of_other_runs(output_dir, run_id, identity)
    if others:
        raise CheckpointOfAnotherRunError(
            f"`output_dir` ({output_dir}) holds checkpoints of another run than the one resumed from {checkpoint}: "
            f"{others}. Its checkpoints would be mixed with this run's. Resume in that run's own folder, or move "
            "them away."
        )
    return run_id


def refuse_checkpoints_of_other_runs(output_dir: str, run_id: str, identity: dict, target: str) -> None:
    """Just before checkpoint `target` is renamed into place: raise `CheckpointOfAnotherRunError` naming this
    run and the other's checkpoints if `output_dir` holds any (two runs started in one folder), keeping them."""
    others = checkpoints_of_other_runs(output_dir, run_id, identity)
    if others:
        raise CheckpointOfAnotherRunError(
            f"Not writing {target}: `output_dir` ({output_dir}) holds checkpoints of another run: {others}; this "
            f"run is run {run_id}. Two runs share this `output_dir` (started there before either saved, or a "
            "`step()` run beside a `train()` run); the other run's checkpoints are kept. Give this run its own "
            "`output_dir`."
        )

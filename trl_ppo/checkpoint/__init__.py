"""Checkpoints that resume a run exactly, and are never half-written.

A checkpoint folder `checkpoint-<update>` holds:
* the policy in the Hugging Face format (root; a value head as `value_head.safetensors`) and a separate value
  model in `value_model/` (written by `PPOTrainer.save_model`), or under DeepSpeed its own `global_step*/`;
* `optimizer.pt`, `scheduler.pt` (and a scaler), from `transformers.Trainer`;
* `rng_state_<process>.pth`: every RNG of each process (`rng.py`);
* `trainer_state.json`: `PPOTrainerState` (update, episode, log history, stateful callbacks);
* `trl_ppo_state.json`: the `RunState` (with the run id, `ownership.py`) and the run's identity (`identity.py`);
* `manifest.json`, written last: every other file's size and SHA-256 (`manifest.py`), verified before a resume
  loads anything.
It is written under `tmp-checkpoint-<update>-<run id>` and renamed into place once complete (`folders.py`), unless
`output_dir` holds a checkpoint of another run (`ownership.py`). A save that fails removes its partial folder and
raises `CheckpointSaveError`; the earlier checkpoints are untouched. Weights holding NaN or infinity are never
written: the save raises `FloatingPointError` naming the tensor first. A run starting in `output_dir`
(`start_checkpoint`) changes nothing there until it is allowed to use it.
"""

from __future__ import annotations

import os
import pickle
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from transformers.utils import logging

from .folders import (
    CHECKPOINT_PREFIX,
    PPO_STATE_NAME,
    STAGING_PREFIX,
    checkpoint_to_resume,
    complete_checkpoints,
    is_auto,
    latest_checkpoint,
    publish_checkpoint,
    put_back_retired_checkpoints,
    read_json,
    remove_unfinished_saves,
    rotate_checkpoints,
    set_aside_newer_checkpoints,
    staging_folder,
    write_json,
)
from .identity import check_resumable, model_fingerprint, prompts_fingerprint, run_identity
from .manifest import MANIFEST_NAME, manifest_of
from .ownership import CheckpointOfAnotherRunError, refuse_checkpoints_of_other_runs, run_to_continue
from .preemption import PreemptionHandler, stop_requested
from .rng import capture_rng_state, load_rng_state, rng_file
from .run_lock import describe_holder, release_run_lock, take_run_lock
from .weights import checkpoint_layout, load_trained_weights, named_weights, nonfinite_tensor

logger = logging.get_logger(__name__)


@dataclass
class ResumePoint:
    """Everything besides weights, optimizer and `PPOTrainerState` that decides what a run does next, at one
    moment: this process's RNG states and the `RunState` (as `state_dict()`)."""

    rng: dict
    run_state: dict

    @classmethod
    def capture(cls, run_state) -> "ResumePoint":
        return cls(capture_rng_state(), run_state.state_dict())


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (e.g. the disk is full); the earlier checkpoints are kept."""


def save_checkpoint(
    output_dir: str,
    step: int,
    accelerator,
    resume_point: ResumePoint,
    identity: dict,
    write_weights: Callable[[str], None],
    write_trainer_state: Callable[[str], None],
    save_total_limit: int | None = None,
    weights: Iterable[tuple[str, torch.Tensor]] = (),
) -> str:
    """Write `checkpoint-<step>` under a temporary name and rename it into place once complete -> its path.

    `write_weights(folder)` writes the models and optimizer state (on every process: under DeepSpeed it is a
    collective); `write_trainer_state(path)` the trainer state, on the main process. The `ResumePoint` may be
    older than now: that is how a dropped rollout is undone (the weights have not changed since it was taken).
    If any process fails to write its part, every process raises `CheckpointSaveError` saying why, the partial
    folder is removed and no older checkpoint is rotated away. Before anything is written, every process checks
    its named `weights`: one holding NaN or infinity raises `FloatingPointError` naming it, on every process."""
    check_finite_weights(accelerator, weights, output_dir, step)
    staging = staging_folder(output_dir, step, resume_point.run_state.get("run_id"), clear=accelerator.is_main_process)
    accelerator.wait_for_everyone()

    def write_process_part() -> None:
        write_weights(staging)
        os.makedirs(staging, exist_ok=True)
        torch.save(resume_point.rng, rng_file(staging, accelerator.process_index))

    def write_main_part() -> str:
        write_trainer_state(os.path.join(staging, "trainer_state.json"))
        run_state = {**resume_point.run_state, "identity": identity, "manifest": MANIFEST_NAME}
        write_json(os.path.join(staging, PPO_STATE_NAME), run_state)
        write_json(os.path.join(staging, MANIFEST_NAME), manifest_of(staging))  # last: then it is whole
        target = os.path.join(output_dir, f"{CHECKPOINT_PREFIX}{step}")
        refuse_checkpoints_of_other_runs(output_dir, resume_point.run_state["run_id"], identity, target)
        final = publish_checkpoint(staging, output_dir, step)
        rotate_checkpoints(output_dir, save_total_limit, keep=final)
        return final

    _on_all_or_fail(accelerator, write_process_part, staging, output_dir, step)
    final = _on_all_or_fail(accelerator, write_main_part, staging, output_dir, step, main_only=True)
    return final or os.path.join(output_dir, f"{CHECKPOINT_PREFIX}{step}")


def nonfinite_weight_of_any_process(accelerator, weights: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The first of `weights` that holds NaN or infinity on any process (each checks its own: under ZeRO-3 its
    partition), the same on every process, so that all of them refuse a save together; or None. A collective."""
    found = [name for name in _gather(accelerator, nonfinite_tensor(weights)) if name is not None]
    return found[0] if found else None


def check_finite_weights(accelerator, weights: Iterable[tuple[str, torch.Tensor]], output_dir: str, step: int) -> None:
    """Refuse, on every process, to write `checkpoint-<step>` of `weights` when a process finds one non-finite."""
    found = nonfinite_weight_of_any_process(accelerator, weights)
    if found is not None:
        raise FloatingPointError(
            f"Not writing checkpoint-{step}: the weight `{found}` holds NaN or infinity (training diverged). "
            f"Nothing was written; the checkpoints in {output_dir} are kept (newest: "
            f"{latest_checkpoint(output_dir) or 'none'}). Resume from one with a lower `learning_rate`, or check "
            "the reward scale and the loss coefficients."
        )


def _on_all_or_fail(accelerator, write: Callable, staging: str, output_dir: str, step: int, main_only=False):
    """Run `write` (on the main process only with `main_only`), then share every process's failure (a collective
    in place of a barrier, so no process waits forever on one that failed) -> `write`'s result. Each failure
    travels with its error's type, so every process raises the same kind of error, with the same advice."""
    result, failure, cause = None, None, None
    if accelerator.is_main_process or not main_only:
        try:
            result = write()
        except Exception as error:  # disk full, quota, permissions, a serializer's own error
            failure, cause = (accelerator.process_index, type(error).__name__, str(error)), error
    failures = [f for f in _gather(accelerator, failure) if f is not None]
    if failures:
        if accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)  # frees the space a full disk needs
        refusals = [text for _, kind, text in failures if kind == CheckpointOfAnotherRunError.__name__]
        if refusals:  # not a write error: the advice below would not help
            message = f"{refusals[0]} (This run's checkpoint-{step} was not written.)"
            raise CheckpointOfAnotherRunError(message) from None
        kept = latest_checkpoint(output_dir)
        described = "; ".join(f"process {index}: {kind}: {text}" for index, kind, text in failures)
        raise CheckpointSaveError(
            f"Saving checkpoint-{step} failed ({described}). Its partial folder was removed; the earlier "
            f"checkpoints are kept (newest: {kept or 'none'}). Free space (or fix the cause), then resume with "
            "`resume_from_checkpoint=True`."
        ) from cause
    return result


def _gather(accelerator, item) -> list:
    if accelerator.num_processes == 1:
        return [item]
    from accelerate.utils import gather_object

    return gather_object([item])


class RunStart(NamedTuple):
    """How a run starts: the checkpoint it resumes from (None: a fresh run) and its run id (`ownership.py`)."""

    checkpoint: str | None
    run_id: str


def start_checkpoint(
    output_dir: str, resume_from_checkpoint: str | bool | None, accelerator, identity: dict, overwrite: bool = False
) -> RunStart:
    """At the start of a run: choose the checkpoint to resume from and the run id, refusing an `output_dir` that
    holds another run's checkpoints; only then prepare the folder (`claim_output_dir`). On the main process only
    (verifying reads every file once); every process gets the same start, or the same refusal: whatever the main
    process raises is shared with the others before it is raised (they would otherwise wait here forever)."""
    outcome = [None, None, None]  # (checkpoint, run id, error)
    if accelerator.is_main_process:
        try:
            outcome = [*claim_output_dir(output_dir, resume_from_checkpoint, identity, overwrite), None]
        except Exception as error:  # any: a malformed file's TypeError as much as a refusal's ValueError
            outcome = [None, None, error]
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        shared = [outcome[0], outcome[1], _portable(outcome[2])]
        broadcast_object_list(shared)
        if not accelerator.is_main_process:
            outcome = shared
    if outcome[2] is not None:
        raise outcome[2]
    return RunStart(outcome[0], outcome[1])


def claim_output_dir(
    output_dir: str, resume_from_checkpoint: str | bool | None, identity: dict, overwrite: bool = False
) -> tuple[str | None, str]:
    """Take the run lock of `output_dir` (`run_lock.py`; released again if the run is refused), put back whole
    checkpoints an interrupted save had set aside (`folders.put_back_retired_checkpoints`), then -> (the
    checkpoint to resume from, or None: `checkpoint_to_resume`, where `overwrite` deletes an earlier run's
    checkpoints for a fresh run; the run id: `ownership.run_to_continue`, which refuses another run's folder).
    Only once the run may use `output_dir` is anything else there changed: what interrupted saves left is removed
    (a refused run must not delete the save another run has in progress), and a resume from an older checkpoint
    sets the newer ones aside (`folders.set_aside_newer_checkpoints`)."""
    took_lock = take_run_lock(output_dir)  # first: a run started beside this one now waits or is refused
    try:
        put_back_retired_checkpoints(output_dir)  # whole ones, before a checkpoint is chosen
        checkpoint = checkpoint_to_resume(output_dir, resume_from_checkpoint, overwrite)
        run_id = run_to_continue(output_dir, checkpoint, identity)
    except BaseException:
        if took_lock:
            release_run_lock(output_dir)
        raise
    describe_holder(output_dir, run_id)
    if is_auto(resume_from_checkpoint) and checkpoint is None:  # a resume says so itself, when it loads
        logger.warning(f"`resume_from_checkpoint='auto'`: no checkpoint in {output_dir}, so a new run starts there.")
    remove_unfinished_saves(output_dir)
    if checkpoint is not None:
        set_aside_newer_checkpoints(output_dir, checkpoint)
    return checkpoint, run_id


def _portable(error: Exception | None) -> Exception | None:
    """`error` as it can travel to the other processes (pickled), or a `RuntimeError` that describes it."""
    if error is None:
        return None
    try:
        return pickle.loads(pickle.dumps(error))
    except Exception:  # an exception type that does not pickle (e.g. a required keyword argument)
        return RuntimeError(f"The main process could not start the run: {type(error).__name__}: {error}")


def read_run_state(path: str, identity: dict, layout: str | None) -> dict:
    """The saved `RunState` of checkpoint `path` (as `state_dict()`), after checking that this run (`identity`,
    launched under `layout`: "DeepSpeed", "FSDP" or None, as `weights.checkpoint_layout` names them) can resume
    it."""
    state_file = os.path.join(path, PPO_STATE_NAME)
    saved = read_json(state_file)
    saved.pop("manifest", None)
    if not isinstance(saved.get("identity"), dict):
        raise ValueError(f"{state_file} holds no run identity (an `identity` object): it is damaged.")
    check_resumable(saved.pop("identity"), identity, path)
    written = checkpoint_layout(path)
    if not (written == "DeepSpeed" or _has_optimizer_state(path)):
        raise ValueError(f"{path} has no optimizer state (written with `save_only_model=True`): it cannot be resumed.")
    if written != "DeepSpeed" and not os.path.isfile(os.path.join(path, "scheduler.pt")):
        raise ValueError(f"{path} has no scheduler.pt: resuming would restart the learning-rate schedule.")
    if layout != written:
        raise ValueError(
            f"{path} was written {f'with {written}' if written else 'without DeepSpeed or FSDP'}, and this run is "
            f"{f'under {layout}' if layout else 'under neither'}: resume it the way it was launched."
        )
    return saved


def _has_optimizer_state(path: str) -> bool:
    """`optimizer.pt` (plain), or FSDP's `optimizer.bin` (whole) or `optimizer_0/` (sharded)."""
    return any(os.path.exists(os.path.join(path, name)) for name in ("optimizer.pt", "optimizer.bin", "optimizer_0"))


__all__ = [
    "CHECKPOINT_PREFIX",
    "CheckpointOfAnotherRunError",
    "CheckpointSaveError",
    "PPO_STATE_NAME",
    "STAGING_PREFIX",
    "PreemptionHandler",
    "ResumePoint",
    "RunStart",
    "checkpoint_to_resume",
    "complete_checkpoints",
    "is_auto",
    "latest_checkpoint",
    "load_rng_state",
    "load_trained_weights",
    "model_fingerprint",
    "named_weights",
    "nonfinite_tensor",
    "nonfinite_weight_of_any_process",
    "prompts_fingerprint",
    "read_run_state",
    "release_run_lock",
    "remove_unfinished_saves",
    "run_identity",
    "save_checkpoint",
    "start_checkpoint",
    "stop_requested",
]

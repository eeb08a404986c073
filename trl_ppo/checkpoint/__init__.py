"""Checkpoints that resume a run exactly, and are never half-written.

A checkpoint folder `checkpoint-<update>` holds:
* the policy in the Hugging Face format (root; a value head as `value_head.safetensors`) and a separate value
  model in `value_model/` (written by `PPOTrainer.save_model`), or under DeepSpeed its own `global_step*/`;
* `optimizer.pt`, `scheduler.pt` (and a scaler), from `transformers.Trainer`;
* `rng_state_<process>.pth`: every RNG of each process (`rng.py`);
* `trainer_state.json`: `PPOTrainerState` (update, episode, log history, stateful callbacks);
* `trl_ppo_state.json`, written last: the `RunState` and the run's identity (`identity.py`).
It is written under `tmp-checkpoint-<update>` and renamed into place once complete (`folders.py`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .folders import (
    CHECKPOINT_PREFIX,
    PPO_STATE_NAME,
    STAGING_PREFIX,
    checkpoint_to_resume,
    complete_checkpoints,
    latest_checkpoint,
    publish_checkpoint,
    rotate_checkpoints,
    staging_folder,
    write_json,
)
from .identity import check_resumable, model_fingerprint, run_identity
from .preemption import PreemptionHandler, stop_requested
from .rng import capture_rng_state, load_rng_state, rng_file
from .weights import has_deepspeed_state, load_trained_weights


@dataclass
class ResumePoint:
    """Everything besides weights, optimizer and `PPOTrainerState` that decides what a run does next, at one
    moment: this process's RNG states and the `RunState` (as `state_dict()`)."""

    rng: dict
    run_state: dict

    @classmethod
    def capture(cls, run_state) -> "ResumePoint":
        return cls(capture_rng_state(), run_state.state_dict())


def save_checkpoint(
    output_dir: str,
    step: int,
    accelerator,
    resume_point: ResumePoint,
    identity: dict,
    write_weights: Callable[[str], None],
    write_trainer_state: Callable[[str], None],
    save_total_limit: int | None = None,
) -> str:
    """Write `checkpoint-<step>` under a temporary name and rename it into place once complete -> its path.

    `write_weights(folder)` writes the models and optimizer state (on every process: under DeepSpeed it is a
    collective); `write_trainer_state(path)` the trainer state, on the main process. The `ResumePoint` may be
    older than now: that is how a dropped rollout is undone (the weights have not changed since it was taken)."""
    staging = os.path.join(output_dir, f"{STAGING_PREFIX}{step}")
    if accelerator.is_main_process:
        staging_folder(output_dir, step)  # clears what an interrupted save left behind
    accelerator.wait_for_everyone()
    write_weights(staging)
    os.makedirs(staging, exist_ok=True)
    torch.save(resume_point.rng, rng_file(staging, accelerator.process_index))
    accelerator.wait_for_everyone()
    final = os.path.join(output_dir, f"{CHECKPOINT_PREFIX}{step}")
    if accelerator.is_main_process:
        write_trainer_state(os.path.join(staging, "trainer_state.json"))
        write_json(os.path.join(staging, PPO_STATE_NAME), {**resume_point.run_state, "identity": identity})  # last
        final = publish_checkpoint(staging, output_dir, step)
        rotate_checkpoints(output_dir, save_total_limit, keep=final)
    accelerator.wait_for_everyone()
    return final


def read_run_state(path: str, identity: dict, deepspeed: bool) -> dict:
    """The saved `RunState` of checkpoint `path` (as `state_dict()`), after checking that this run (`identity`,
    launched with or without DeepSpeed) can resume it."""
    with open(os.path.join(path, PPO_STATE_NAME), encoding="utf-8") as handle:
        saved = json.load(handle)
    check_resumable(saved.pop("identity"), identity, path)
    written_with_deepspeed = has_deepspeed_state(path)
    if not (written_with_deepspeed or os.path.isfile(os.path.join(path, "optimizer.pt"))):
        raise ValueError(f"{path} has no optimizer state (written with `save_only_model=True`): it cannot be resumed.")
    if deepspeed != written_with_deepspeed:
        raise ValueError(
            f"{path} was written {'with' if written_with_deepspeed else 'without'} DeepSpeed, and this run is "
            f"{'' if deepspeed else 'not '}under DeepSpeed: resume it the way it was launched."
        )
    return saved


__all__ = [
    "CHECKPOINT_PREFIX",
    "PPO_STATE_NAME",
    "STAGING_PREFIX",
    "PreemptionHandler",
    "ResumePoint",
    "checkpoint_to_resume",
    "complete_checkpoints",
    "latest_checkpoint",
    "load_rng_state",
    "load_trained_weights",
    "model_fingerprint",
    "read_run_state",
    "run_identity",
    "save_checkpoint",
    "stop_requested",
]

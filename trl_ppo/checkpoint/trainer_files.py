"""The part of a checkpoint that belongs to `transformers.Trainer`: the models as `save_model` writes them, the
optimizer, scheduler and scaler states, the trainer state and the stateful callbacks; written and read back
through `Trainer`'s own (private) methods, as no public ones exist (checked against transformers 5.23)."""

from __future__ import annotations

import os

from transformers import Trainer, TrainerControl
from transformers.trainer_callback import ExportableState

from ..models import PreparedModels
from ..run_state import PPOTrainerState, RunState
from . import (
    ResumePoint,
    load_rng_state,
    load_trained_weights,
    named_weights,
    read_json,
    read_run_state,
    save_checkpoint,
)


def exportable_callbacks(trainer: Trainer) -> list:
    """The callbacks (and control flags) whose state a checkpoint keeps."""
    callbacks = trainer.callback_handler.callbacks + [trainer.control]
    return [callback for callback in callbacks if isinstance(callback, ExportableState)]


def write_trainer_checkpoint(trainer: Trainer, resume_point: ResumePoint, identity: dict) -> str:
    """`checkpoint-<global_step>` of `trainer` with the run's `resume_point` and `identity` -> its path."""
    args = trainer.args

    def write_weights(folder: str) -> None:
        trainer.save_model(folder, _internal_call=True)
        if not args.save_only_model:
            trainer._save_optimizer_and_scheduler(folder)
            trainer._save_scaler(folder)

    def write_trainer_state(path: str) -> None:
        trainer.state.stateful_callbacks = PPOTrainerState(
            stateful_callbacks=exportable_callbacks(trainer)
        ).stateful_callbacks
        trainer.state.save_to_json(path)

    return save_checkpoint(
        args.output_dir,
        trainer.state.global_step,
        trainer.accelerator,
        resume_point,
        identity,
        write_weights,
        write_trainer_state,
        args.save_total_limit,
        weights=named_weights(trainer.accelerator.unwrap_model(trainer.model)),
    )


def restore_trainer_checkpoint(trainer: Trainer, run: RunState, path: str, identity: dict) -> PPOTrainerState:
    """Resume from checkpoint `path`, after checking that it was written by a run of this `identity`: the trained
    weights, optimizer and scheduler into `trainer`, the saved run state into `run`, this process's RNG states
    -> the saved trainer state (also set on `trainer`, whose callbacks read it)."""
    models = PreparedModels(trainer.accelerator, trainer.model, None)
    saved = read_run_state(path, identity, "DeepSpeed" if models.is_deepspeed else "FSDP" if models.is_fsdp2 else None)
    load_trained_weights(path, models)
    state = read_trainer_checkpoint(trainer, path)
    if "episode" in saved:  # written by trl_ppo before `PPOTrainerState` kept it
        state.episode = saved["episode"]
    run.load_state_dict(saved)
    run.last_checkpoint = (state.global_step, path)
    load_rng_state(path, trainer.accelerator.process_index)
    return state


def read_trainer_checkpoint(trainer: Trainer, path: str) -> PPOTrainerState:
    """Load the optimizer and scheduler of checkpoint `path` into `trainer` (under DeepSpeed the scheduler only:
    the engine holds the rest) and give its stateful callbacks (e.g. early stopping's patience) their saved
    state -> the saved trainer state. The callbacks' state is part of an exact resume, so it is restored whatever
    `restore_callback_states_from_checkpoint` says; the control flags start fresh (a checkpoint written at the
    last update must not stop a resumed run that was given more episodes)."""
    trainer._load_optimizer_and_scheduler(path)
    state_file = os.path.join(path, "trainer_state.json")
    read_json(state_file)  # a damaged file is named
    state = PPOTrainerState.load_from_json(state_file)
    trainer.state, requested = state, trainer.args.restore_callback_states_from_checkpoint
    trainer.args.restore_callback_states_from_checkpoint = True
    try:
        trainer._load_callback_state()  # reads `trainer.state.stateful_callbacks`
    finally:
        trainer.args.restore_callback_states_from_checkpoint = requested
    trainer.control = TrainerControl()
    return state

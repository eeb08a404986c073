"""What exact resume needs beyond `transformers.Trainer`, and checkpoints that are never half-written.

A checkpoint folder `checkpoint-<update>` holds the policy (root, Hugging Face format), the value model
(`value_model/`), optimizer and scheduler states, one RNG file per process, `trainer_state.json`, and
`trl_ppo_state.json` (counters, data position, metrics not yet logged, and what must match to resume). It is
written under `tmp-checkpoint-<update>` and renamed into place only when complete, so a folder named
`checkpoint-*` is always whole.
"""

from __future__ import annotations

import glob
import json
import os
import random
import re
import shutil
import signal
import threading

import numpy as np
import torch
from transformers import TrainerControl, TrainerState
from transformers.trainer_callback import ExportableState
from transformers.utils import logging

from .value_head import VALUE_HEAD_FILE, is_value_head_model, sub_state_dict

logger = logging.get_logger(__name__)

PPO_STATE_NAME = "trl_ppo_state.json"
CHECKPOINT_PREFIX = "checkpoint-"
STAGING_PREFIX = "tmp-checkpoint-"

# Settings that decide the shape of the run: resuming with another value cannot reproduce it.
MUST_MATCH = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "num_mini_batches",
    "world_size",
    "batch_size",
    "response_length",
    "seed",
)


# --------------------------------------------------------------------------------------------- RNG states
def capture_rng_state() -> dict:
    """Every RNG this process draws from (python, numpy, torch CPU and CUDA)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.random.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.random.set_rng_state_all(state["cuda"])


def rng_file(folder: str, process_index: int) -> str:
    return os.path.join(folder, f"rng_state_{process_index}.pth")


def load_rng_state(folder: str, process_index: int) -> None:
    path = rng_file(folder, process_index)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: this checkpoint was written by a run with fewer processes.")
    # The file holds numpy/python RNG tuples, which the safe loader does not know.
    restore_rng_state(torch.load(path, weights_only=False))


# -------------------------------------------------------------------------------------------- fingerprints
def model_fingerprint(model: torch.nn.Module | None) -> dict | None:
    """A cheap identity of a model's weights: class, parameter count and a checksum of every tensor's first
    elements. Enough to tell another model (or another initial policy) from the one a run started with."""
    if model is None or not isinstance(model, torch.nn.Module):
        return None
    total, checksum = 0, 0.0
    for parameter in model.state_dict().values():
        total += parameter.numel()
        if parameter.numel():
            checksum += float(parameter.detach().reshape(-1)[:256].double().sum())
    return {"class": type(model).__name__, "num_parameters": total, "checksum": round(checksum, 6)}


def run_identity(args, models: dict) -> dict:
    """What must match between the run that wrote a checkpoint and the run that resumes it."""
    identity = {name: getattr(args, name) for name in MUST_MATCH}
    identity.update({f"{name}_fingerprint": model_fingerprint(model) for name, model in models.items()})
    return identity


def check_resumable(saved: dict, current: dict, checkpoint: str) -> None:
    """Raise an error that names every difference between the saved and the current run identity."""
    differences = [
        f"`{key}`: checkpoint has {saved.get(key)!r}, this run has {current.get(key)!r}"
        for key in current
        if saved.get(key) != current[key]
    ]
    if differences:
        raise ValueError(
            f"Cannot resume from {checkpoint}: it was written by a different run.\n  "
            + "\n  ".join(differences)
            + "\nResume with the same batch layout, seed and models, or start a new run in another `output_dir`."
        )


# --------------------------------------------------------------------------------------- folders and files
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


# --------------------------------------------------------------------------------------------- weights
def load_weights_into(model: torch.nn.Module, folder: str) -> None:
    """Load weights written by `save_pretrained` (a PEFT adapter, or a full model) into `model` in place.

    A full model is read back through its class's `from_pretrained`, which knows how the saved names map onto
    the in-memory ones (they differ for some architectures); this holds a second copy in CPU memory for a moment.
    """
    from safetensors.torch import load_file

    if is_value_head_model(model):  # the causal LM as below, then its head
        load_weights_into(model.pretrained_model, folder)
        if not model.load_value_head(folder):
            raise FileNotFoundError(f"{folder} has no {VALUE_HEAD_FILE}: it was not written by a value-head policy.")
        return
    adapter = os.path.join(folder, "adapter_model.safetensors")
    if os.path.isfile(adapter):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(adapter))
        return
    dtype = next(model.parameters()).dtype
    saved = type(model).from_pretrained(folder, dtype=dtype)
    model.load_state_dict(saved.state_dict(), strict=True)
    del saved


# ------------------------------------------------------------------------------------------- preemption
class PreemptionHandler:
    """While active, SIGTERM and SIGINT only set `requested`; the trainer checks it between the steps of an
    update, writes a checkpoint and exits. A second SIGINT interrupts at once (the usual KeyboardInterrupt)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        self.requested = signal.Signals(signum).name
        signal.signal(signal.SIGINT, self._previous.get(signal.SIGINT, signal.default_int_handler))

    def __enter__(self) -> "PreemptionHandler":
        if threading.current_thread() is threading.main_thread():  # signals can only be caught there
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


# ------------------------------------------------------------------------------------ the trainer's part
class CheckpointingMixin:
    """Checkpoint writing, resuming and preemption for `PPOTrainer` (mixed in before `transformers.Trainer`).

    It relies on the trainer's `state`, `control`, `accelerator`, `model`, `data_position`, `_metrics_since_log`,
    `_policy_loss_sum`, `_skipped_updates`, `kl_coef`, `score_moments` and `_run_identity`. It also writes the
    trained models (`save_model`).
    """

    def _exportable_callbacks(self) -> list:
        return [cb for cb in self.callback_handler.callbacks + [self.control] if isinstance(cb, ExportableState)]

    def _resume_point(self) -> dict:
        """Everything besides weights and optimizer that decides what happens next, as of now."""
        return {
            "rng": capture_rng_state(),
            "state": {
                "episode": self.state.episode,
                "data_position": list(self.data_position),
                "metrics_since_log": self._metrics_since_log.state_dict(),
                "policy_loss_sum": self._policy_loss_sum,
                "skipped_updates": self._skipped_updates,
                "kl_coef": self.kl_coef,
                "score_moments": self.score_moments.state_dict(),
                "identity": self._run_identity,
            },
        }

    def _save_checkpoint(self, model, trial, resume_point: dict | None = None) -> str:
        """Write `checkpoint-<update>` under a temporary name and rename it into place once complete.

        `resume_point` (from `_resume_point`) replaces the current RNG states and counters; it is how a dropped
        rollout is undone: the weights have not changed since the end of the previous update.
        """
        args = self.args
        step = self.state.global_step
        resume_point = resume_point if resume_point is not None else self._resume_point()
        staging = os.path.join(args.output_dir, f"{STAGING_PREFIX}{step}")
        if self.accelerator.is_main_process:
            staging_folder(args.output_dir, step)  # clears what an interrupted save left behind
        self.accelerator.wait_for_everyone()
        self.save_model(staging, _internal_call=True)
        if not args.save_only_model:
            self._save_optimizer_and_scheduler(staging)
            self._save_scaler(staging)
        os.makedirs(staging, exist_ok=True)
        torch.save(resume_point["rng"], rng_file(staging, self.accelerator.process_index))
        self.accelerator.wait_for_everyone()
        final = os.path.join(args.output_dir, f"{CHECKPOINT_PREFIX}{step}")
        if self.accelerator.is_main_process:
            self.state.stateful_callbacks = TrainerState(
                stateful_callbacks=self._exportable_callbacks()
            ).stateful_callbacks
            self.state.save_to_json(os.path.join(staging, "trainer_state.json"))
            write_json(os.path.join(staging, PPO_STATE_NAME), resume_point["state"])  # written last
            final = publish_checkpoint(staging, args.output_dir, step)
            rotate_checkpoints(args.output_dir, args.save_total_limit, keep=final)
        self.accelerator.wait_for_everyone()
        self._last_checkpoint = (step, final)
        logger.info(f"Checkpoint of update {step} written to {final}")
        return final

    def _checkpoint_to_resume(self, resume_from_checkpoint: str | bool | None) -> str | None:
        """The checkpoint folder to resume from (None for a fresh run), refusing to overwrite an earlier run."""
        output_dir = self.args.output_dir
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
                raise ValueError(
                    f"`resume_from_checkpoint=True`: no complete checkpoint in `output_dir` ({output_dir})."
                )
            return path
        path = str(resume_from_checkpoint)
        if not os.path.isfile(os.path.join(path, PPO_STATE_NAME)):
            raise ValueError(
                f"`resume_from_checkpoint` ({path}) is not a complete trl_ppo checkpoint (no {PPO_STATE_NAME})."
            )
        return path

    def _restore_checkpoint(self, path: str) -> None:
        with open(os.path.join(path, PPO_STATE_NAME), encoding="utf-8") as handle:
            saved = json.load(handle)
        check_resumable(saved["identity"], self._run_identity, path)
        deepspeed_state = glob.glob(os.path.join(path, "global_step*"))
        if not (deepspeed_state or os.path.isfile(os.path.join(path, "optimizer.pt"))):
            raise ValueError(
                f"{path} has no optimizer state (written with `save_only_model=True`): it cannot be resumed."
            )
        if self.is_deepspeed_enabled != bool(deepspeed_state):
            raise ValueError(
                f"{path} was written {'with' if deepspeed_state else 'without'} DeepSpeed, and this run is "
                f"{'' if self.is_deepspeed_enabled else 'not '}under DeepSpeed: resume it the way it was launched."
            )
        if self.is_deepspeed_enabled:  # weights and optimizer state, each process its own partition
            from transformers.integrations.deepspeed import deepspeed_load_checkpoint

            deepspeed_load_checkpoint(self.model_wrapped, path)
        else:
            wrapper = self.accelerator.unwrap_model(self.model)
            load_weights_into(wrapper.policy, path)
            if wrapper.value_model is not None:
                load_weights_into(wrapper.value_model, os.path.join(path, "value_model"))
        self._load_optimizer_and_scheduler(path)  # under DeepSpeed, the scheduler only
        self.state = TrainerState.load_from_json(os.path.join(path, "trainer_state.json"))
        self._restore_callback_states()
        self.state.episode = saved["episode"]
        self.data_position = tuple(saved["data_position"])
        self._metrics_since_log.load_state_dict(saved["metrics_since_log"])
        self._policy_loss_sum = saved["policy_loss_sum"]
        self._skipped_updates = saved["skipped_updates"]
        self.kl_coef = saved["kl_coef"]
        self.score_moments.load_state_dict(saved["score_moments"])
        self._last_checkpoint = (self.state.global_step, path)
        load_rng_state(path, self.accelerator.process_index)
        logger.warning(f"Resuming from {path}: update {self.state.global_step}, episode {self.state.episode}.")

    def _restore_callback_states(self) -> None:
        """Give stateful callbacks (e.g. early stopping's patience) their saved state: part of an exact resume, so
        done whatever `restore_callback_states_from_checkpoint` says. The control flags start fresh: a checkpoint
        written at the last update must not stop a resumed run that was given more episodes."""
        requested = self.args.restore_callback_states_from_checkpoint
        self.args.restore_callback_states_from_checkpoint = True
        try:
            self._load_callback_state()
        finally:
            self.args.restore_callback_states_from_checkpoint = requested
        self.control = TrainerControl()

    def _stop_requested(self, preemption: "PreemptionHandler") -> bool:
        """Whether any process got SIGTERM/SIGINT (all processes must stop at the same point)."""
        flag = torch.tensor([1.0 if preemption.requested else 0.0], device=self.accelerator.device)
        return bool(self.accelerator.reduce(flag, reduction="sum").item() > 0)

    def _exit_after_checkpoint(self, signal_name: str | None, resume_point: dict | None) -> None:
        step = self.state.global_step
        if self._last_checkpoint is not None and self._last_checkpoint[0] == step:
            path = self._last_checkpoint[1]
        else:
            path = self._save_checkpoint(self.model, trial=None, resume_point=resume_point)
        logger.warning(
            f"Stopped by {signal_name or 'a signal'} after update {step} of {self.args.num_total_batches}; "
            f"checkpoint: {path}. Resume with `train(resume_from_checkpoint=True)`."
        )
        raise SystemExit(0)

    # ---------------------------------------------------------------------------------------------- saving
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the policy (or its PEFT adapter) and tokenizer in the Hugging Face format; checkpoints and
        `save_value_model=True` also write a separate value model to `<output_dir>/value_model`. A shared value
        head is always written, as `value_head.safetensors` beside the policy."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        super().save_model(output_dir, _internal_call=_internal_call)
        if _internal_call or self.args.save_value_model:
            self._save_value_model(os.path.join(output_dir, "value_model"))
        if not _internal_call and self.args.should_save:
            self._write_model_card(output_dir)

    def _write_model_card(self, output_dir: str) -> None:
        """README.md beside the saved policy: base model, prompts, rewards, hyper-parameters, final metrics and
        the training curves (`training_curves.png`, drawn from the run's log)."""
        from .reporting import PLOT_FILE, model_card, plot_curves

        args, history = self.args, self.state.log_history
        lm = self.accelerator.unwrap_model(self.model).lm
        rewards = [
            f"{reward.name} ({getattr(getattr(reward.source, 'config', None), '_name_or_path', '') or 'a model'})"
            if reward.is_model
            else f"{reward.name} (a function)"
            for reward in self.rewards
        ]
        weights = args.reward_weights
        if weights:
            rewards = [f"{weight} x {reward}" for weight, reward in zip(weights, rewards)]
        names = ("learning_rate", "batch_size", "total_episodes", "num_ppo_epochs", "num_mini_batches", "kl_coef")
        names += ("kl_estimator", "cliprange", "cliprange_value", "vf_coef", "gamma", "lam", "response_length")
        names += ("temperature", "missing_eos_penalty", "seed")
        hyperparameters = {name: getattr(args, name) for name in names if hasattr(args, name)}
        final = {}
        for entry in history:
            final.update({k: v for k, v in entry.items() if k.startswith(("objective/", "eval_")) or k == "episode"})
        plot = None
        if any("episode" in entry for entry in history):
            plot_curves(history, os.path.join(output_dir, PLOT_FILE), os.path.basename(os.path.abspath(output_dir)))
            plot = PLOT_FILE
        dataset = self.model_card_dataset or f"{len(self.train_dataset or ())} prompts given as a `datasets.Dataset`"
        card = model_card(getattr(lm.config, "_name_or_path", ""), dataset, rewards, hyperparameters, final, plot)
        with open(os.path.join(output_dir, "README.md"), "w", encoding="utf-8") as handle:
            handle.write(card)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        # `Trainer.save_model` passes the wrapper's state dict (policy. / value_model. keys) or None.
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        policy = self.accelerator.unwrap_model(self.model).policy
        if state_dict is not None:
            state_dict = sub_state_dict(state_dict, "policy.")
        os.makedirs(output_dir, exist_ok=True)
        policy.save_pretrained(output_dir, state_dict=state_dict)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_value_model(self, output_dir: str) -> None:
        value_model = self.accelerator.unwrap_model(self.model).value_model
        if value_model is None:  # a value head, saved with the policy
            return
        state_dict = None
        if self.is_deepspeed_enabled:  # a collective; under ZeRO-3 only the main process receives the weights
            try:
                state_dict = sub_state_dict(self.accelerator.get_state_dict(self.model) or {}, "value_model.")
            except ValueError:  # ZeRO-3 without `stage3_gather_16bit_weights_on_model_save`
                logger.warning(
                    f"The value model was not written to {output_dir}: under ZeRO-3 that needs "
                    "`zero3_save_16bit_model: true` in the accelerate config. A checkpoint still holds it, partitioned."
                )
                return
        if self.args.should_save:
            value_model.save_pretrained(output_dir, state_dict=state_dict)

"""The trained models on disk: the value model beside the policy, and the model card (README.md) that says how
the policy was trained. (`PPOTrainer.save_model` writes the policy and tokenizer through `transformers.Trainer`.)
"""

from __future__ import annotations

import os
import shutil

import torch
from transformers.utils import logging

from .checkpoint import nonfinite_weight_of_any_process
from .checkpoint.folders import replace_folder
from .checkpoint.manifest import unreadable_weights
from .models import PreparedModels
from .reporting import PLOT_FILE, model_card, plot_curves
from .value_head import sub_state_dict

logger = logging.get_logger(__name__)

# The hyper-parameters a model card lists.
CARD_HYPERPARAMETERS = (
    "learning_rate",
    "batch_size",
    "total_episodes",
    "num_ppo_epochs",
    "num_mini_batches",
    "kl_coef",
    "kl_estimator",
    "cliprange",
    "cliprange_value",
    "vf_coef",
    "gamma",
    "lam",
    "response_length",
    "temperature",
    "missing_eos_penalty",
    "seed",
)


def save_policy(models: PreparedModels, tokenizer, args, output_dir: str, state_dict: dict | None = None) -> None:
    """The policy (or its PEFT adapter; a value head beside it), its tokenizer and the config, in the Hugging Face
    format. `state_dict`, when given (e.g. consolidated by DeepSpeed), is the wrapper's (`policy.` / `value_model.`
    keys). The weights were checked finite on every process first (`check_finite_weights`)."""
    if state_dict is not None:
        state_dict = sub_state_dict(state_dict, "policy.")
    os.makedirs(output_dir, exist_ok=True)
    models.wrapper.policy.save_pretrained(output_dir, state_dict=state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(output_dir)
    torch.save(args, os.path.join(output_dir, "training_args.bin"))


def check_writable(output_dir: str) -> None:
    """Refuse an `output_dir` that cannot be written, before any compute: it, or else the nearest folder above it
    that exists, must be a folder this process may write in. Nothing is created."""
    existing = os.path.abspath(output_dir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        problem = f"{existing} is a file, not a folder"
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = f"this process may not write in {existing}"
    else:
        return
    raise ValueError(
        f"`output_dir` ({output_dir}) cannot be written: {problem}. The run's checkpoints, its log and "
        "`save_model()` write there: choose a folder you can write to."
    )


def check_finite_weights(accelerator, weights, output_dir: str) -> None:
    """Refuse to save a model whose named `weights` hold NaN or infinity, naming the first, before any write: on
    every process (a collective), also those that write nothing, which would otherwise go on into the next
    collective of the save (the value model's consolidation) and wait there forever."""
    name = nonfinite_weight_of_any_process(accelerator, weights)
    if name is not None:
        raise FloatingPointError(
            f"Not saving the model to {output_dir}: the weight `{name}` holds NaN or infinity (training diverged). "
            "Nothing was written. Train again from a checkpoint with a lower `learning_rate`, or check the reward "
            "scale and the loss coefficients."
        )


def save_value_model(models: PreparedModels, output_dir: str, should_save: bool) -> None:
    """Write a separate value model to `output_dir` (`save_pretrained`); nothing for a value head, which is
    saved with the policy. Under DeepSpeed the weights are consolidated first (a collective: every process)."""
    value_model = models.wrapper.value_model
    if value_model is None:
        return
    state_dict = None
    if models.is_deepspeed or models.is_fsdp2:  # under ZeRO-3 and FSDP2 only the main process receives the weights
        try:
            state_dict = sub_state_dict(models.accelerator.get_state_dict(models.model) or {}, "value_model.")
        except ValueError:  # ZeRO-3 without `stage3_gather_16bit_weights_on_model_save`
            logger.warning(
                f"The value model was not written to {output_dir}: under ZeRO-3 that needs "
                "`zero3_save_16bit_model: true` in the accelerate config. A checkpoint still holds it, partitioned."
            )
            return
    if should_save:
        value_model.save_pretrained(output_dir, state_dict=state_dict)


def write_model_card(output_dir: str, args, log_history: list[dict], lm, rewards: list, dataset: str) -> None:
    """README.md beside the saved policy `lm`: base model, prompts (`dataset`, in words), rewards, the
    hyper-parameters of `args`, the final metrics of `log_history` and the training curves (`training_curves.png`,
    drawn from the log)."""
    names = [
        f"{reward.name} ({getattr(getattr(reward.source, 'config', None), '_name_or_path', '') or 'a model'})"
        if reward.is_model
        else f"{reward.name} (a function)"
        for reward in rewards
    ]
    if args.reward_weights:
        names = [f"{weight} x {name}" for weight, name in zip(args.reward_weights, names)]
    hyperparameters = {name: getattr(args, name) for name in CARD_HYPERPARAMETERS if hasattr(args, name)}
    final = {}
    for entry in log_history:
        final.update({k: v for k, v in entry.items() if k.startswith(("objective/", "eval_")) or k == "episode"})
    plot = None
    if any("episode" in entry for entry in log_history):
        plot_curves(log_history, os.path.join(output_dir, PLOT_FILE), os.path.basename(os.path.abspath(output_dir)))
        plot = PLOT_FILE
    card = model_card(getattr(lm.config, "_name_or_path", ""), dataset, names, hyperparameters, final, plot)
    with open(os.path.join(output_dir, "README.md"), "w", encoding="utf-8") as handle:
        handle.write(card)


class ModelSaveError(RuntimeError):
    """A model could not be saved (e.g. the disk is full); nothing of the failed save is left in its folder."""


STAGING_NAME = ".tmp-model-save"
LAST_NAMES = ("config.json", "adapter_config.json")  # moved last: a folder with one of them has its weights


def save_atomically(output_dir: str, write, is_writer: bool = True, needed_bytes: int = 0) -> None:
    """Run `write(folder)` into a staging folder inside `output_dir` (on every process: it may hold collectives;
    only the `is_writer` process's files count), verify every weights file written, then move each into
    `output_dir`, the configs last. If writing or verifying fails, the staging folder is removed, `output_dir`
    keeps what it held (an earlier model), and `ModelSaveError` names the folder, the free space there and
    `needed_bytes`, the space the save needs (about)."""
    if os.path.isfile(output_dir):
        raise NotADirectoryError(
            f"Cannot save the model into `output_dir` {output_dir!r}: it is an existing file, and a model is saved "
            "as a folder. Pass the path of a folder (it is created if it does not exist), or move the file away."
        )
    staging = os.path.join(output_dir, STAGING_NAME)
    created = not os.path.isdir(output_dir)
    if is_writer:
        shutil.rmtree(staging, ignore_errors=True)  # what an interrupted save left
        os.makedirs(staging)
    try:
        write(staging)
        if is_writer:
            verify_weights_files(staging)
    except Exception as error:
        if is_writer:
            shutil.rmtree(staging, ignore_errors=True)
            if created and not os.listdir(output_dir):
                os.rmdir(output_dir)
        raise ModelSaveError(save_failure(output_dir, error, needed_bytes)) from error
    if is_writer:
        move_into(staging, output_dir)


def save_failure(output_dir: str, error: Exception, needed_bytes: int) -> str:
    """The message of a save into `output_dir` that failed with `error`."""
    existing = os.path.abspath(output_dir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    free = shutil.disk_usage(existing).free
    return (
        f"Saving the model to {output_dir} failed ({type(error).__name__}: {error}). Nothing of this save was left "
        f"there (an earlier model in it is untouched). The save needs about {needed_bytes / 2**20:.1f} MiB; "
        f"{free / 2**20:.1f} MiB are free there now. Free space (or pass another folder), then save again: the "
        "trained model is still in memory."
    )


def verify_weights_files(folder: str) -> None:
    """Every `*.safetensors` file under `folder` opens and holds the bytes its header declares, else `OSError`
    (the check a checkpoint without a manifest gets, `manifest.unreadable_weights`)."""
    problem = unreadable_weights(folder)
    if problem is not None:
        raise OSError(problem)


def move_into(staging: str, output_dir: str) -> None:
    """Move each entry of `staging` into `output_dir`, replacing one of the same name, configs last."""
    names = sorted(os.listdir(staging), key=lambda name: name in LAST_NAMES)
    for name in names:
        source, target = os.path.join(staging, name), os.path.join(output_dir, name)
        if os.path.isdir(target) and not os.path.islink(target):
            replace_folder(source, target)
        else:
            os.replace(source, target)
    os.rmdir(staging)


def parameter_bytes(*modules) -> int:
    """The bytes of the parameters and buffers of `modules` (None skipped): about what saving them writes."""
    tensors = [t for m in modules if m is not None for t in (*m.parameters(), *m.buffers())]
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())

"""What must match between the run that wrote a checkpoint and the run that resumes it: the settings that
decide the shape of the run, and a fingerprint of each model it started from."""

from __future__ import annotations

import dataclasses
import hashlib

import torch
from transformers import TrainingArguments
from transformers.utils import logging

logger = logging.get_logger(__name__)


class CheckpointOfOtherSettingsError(ValueError):
    """The checkpoint to resume was written by a run of other settings, models or prompts (`check_resumable`): the
    message lists each difference. `trl-ppo` shows it without a traceback."""

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


# Settings a resumed run may change, but whose checkpoint value wins: the optimizer and scheduler states (the
# learning rate) and the run state (the KL coefficient) are restored.
CHECKPOINT_WINS = {"learning_rate": "the optimizer and scheduler states", "kl_coef": "the run state"}
# Settings whose change would splice two learning-rate schedules (the restored step count and base rates, this
# run's shape and length), or regroup the restored optimizer (`critic_learning_rate`): refused.
SCHEDULE = ("lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio", "total_episodes",
            "critic_learning_rate")
# Settings whose change would put the saved position into another data order: prompts seen would be drawn again.
DATA_ORDER = ("data_seed",)
# Settings that choose how the advantages are estimated: a change makes it another algorithm (refused), and why.
ESTIMATOR = {
    "advantage_estimator": "another estimator of the advantages, with or without a critic",
    "num_generations": "other groups of samples per prompt, and another order of the prompts",
    "scale_rewards": "GRPO's advantages scaled another way",
}
# `TrainingArguments` fields worth comparing on resume (the others are paths, hub and hardware settings).
TRAINING_FIELDS = (
    "learning_rate",
    "lr_scheduler_type",
    "lr_scheduler_kwargs",
    "warmup_steps",
    "warmup_ratio",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "max_grad_norm",
    "optim",
    "bf16",
    "fp16",
    "num_train_epochs",
    "gradient_checkpointing",
    "logging_steps",
    "save_steps",
    "eval_steps",
    "save_strategy",
    "eval_strategy",
    "report_to",
    "data_seed",
)


def config_snapshot(args) -> dict:
    """The settings of `args` a checkpoint records, JSON-ready: every field trl_ppo's configs add to
    `TrainingArguments` and the `TRAINING_FIELDS`, each as `repr` where it is not a plain JSON value."""
    own = {f.name for f in dataclasses.fields(args)} - {f.name for f in dataclasses.fields(TrainingArguments)}
    snapshot = {}
    for name in sorted(own | set(TRAINING_FIELDS)):
        value = getattr(args, name, None)
        value = getattr(value, "value", value)  # enums (strategies, scheduler types) by their value
        ok = value is None or isinstance(value, (bool, int, float, str, list, dict))
        snapshot[name] = value if ok else repr(value)
    return snapshot


def config_changes(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """(changes that make it another run, changes allowed) between a checkpoint's `config_snapshot` and this
    run's, each a line naming the setting, both values and which one the resumed run uses."""
    refused, allowed = [], []
    for name in sorted(set(saved) & set(current)):
        old, new = saved[name], current[name]
        if old == new:
            continue
        line = f"`{name}`: {old!r} in the checkpoint, {new!r} now"
        if name in SCHEDULE:
            refused.append(f"{line} (the restored schedule would be spliced with another)")
        elif name in DATA_ORDER:
            refused.append(f"{line} (the saved position would point into another shuffled order of the prompts)")
        elif name in ESTIMATOR:
            refused.append(f"{line} ({ESTIMATOR[name]}: another algorithm; start a new run to change it)")
        elif name in CHECKPOINT_WINS:
            allowed.append(f"{line} -> uses {old!r}, restored with {CHECKPOINT_WINS[name]}")
        else:
            allowed.append(f"{line} -> uses {new!r}")
    return refused, allowed


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


def run_identity(args, fingerprints: dict, reward_names=()) -> dict:
    """What a checkpoint records about its run: the settings of `MUST_MATCH` and the initial models'
    `fingerprints` (`{"<role>_fingerprint": model_fingerprint(model)}`), which must match to resume, and the
    `config` (`config_snapshot`, with the rewards' names: a function's code cannot be compared, its name can),
    whose changes are listed. The fingerprints may include `train_dataset` (`prompts_fingerprint`)."""
    config = {**config_snapshot(args), "rewards": list(reward_names)}
    return {**{name: getattr(args, name) for name in MUST_MATCH}, **fingerprints, "config": config}


def prompts_fingerprint(dataset) -> dict | None:
    """A cheap identity of the prompts a run samples from (after preparation: their token ids): the number of rows,
    which with `seed` fixes the shuffled data order, and a SHA-256 of every row's token ids in order."""
    if dataset is None or "input_ids" not in getattr(dataset, "column_names", ()):
        return None
    import numpy as np
    import pyarrow.compute as pc

    digest, table = hashlib.sha256(), dataset.with_format("arrow")
    for start in range(0, len(dataset), 65536):
        column = table[start : start + 65536].column("input_ids").combine_chunks()
        digest.update(pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64).tobytes())
        digest.update(column.flatten().to_numpy(zero_copy_only=False).astype(np.int64).tobytes())
    return {"rows": len(dataset), "sha256": digest.hexdigest()}


def prompts_changes(saved: dict | None, current: dict | None) -> tuple[list[str], list[str]]:
    """(refused, allowed) lines for a resume with other prompts: another number of rows is another data order (the
    saved position in it would point elsewhere), refused; as many other prompts continue the order, listed. A
    checkpoint of an older trl_ppo, or a run without a `train_dataset`, has nothing to compare."""
    if not saved or not current or saved == current:
        return [], []
    if saved.get("rows") != current["rows"]:
        line = f"`train_dataset`: {saved.get('rows')} prompts in the checkpoint, {current['rows']} now"
        return [f"{line} (the shuffled data order, and the saved position in it, would be another)"], []
    line = f"`train_dataset`: other prompts than the checkpoint's ({current['rows']} rows, another token-id hash)"
    return [], [f"{line} -> uses the new ones, from the saved position in the data order"]


def identity_differences(saved: dict, current: dict) -> list[str]:
    """Each difference between a saved and the current run identity that makes it another run."""
    differences = [
        f"`{key}`: checkpoint has {saved.get(key)!r}, this run has {current.get(key)!r}"
        for key in current
        if key not in ("config", "train_dataset") and saved.get(key) != current[key]
    ]
    refused, _ = config_changes(saved.get("config", {}), current.get("config", {}))  # older checkpoints: none
    prompts = prompts_changes(saved.get("train_dataset"), current.get("train_dataset"))[0]
    return differences + refused + prompts + value_head_init_change(saved, current)


def value_head_init_change(saved: dict, current: dict) -> list[str]:
    """When the initial policies differ and so does `value_head_init` (the value head the trainer adds; a checkpoint
    written before the option existed had the head drawn, 'normal'), that change, and how to resume. Not with a
    separate value model: no head is added then, so the option cannot be why the policies differ."""
    saved_config, now = saved.get("config", {}), current.get("config", {}).get("value_head_init")
    was = saved_config.get("value_head_init", "normal")
    if now is None or was == now or saved.get("policy_fingerprint") == current.get("policy_fingerprint"):
        return []
    if current.get("value_model_fingerprint") is not None:
        return []
    when = "" if "value_head_init" in saved_config else " (written before the option existed)"
    return [f"`value_head_init`: checkpoint has {was!r}{when}, this run has {now!r}: the added value head starts "
            f"differently. If the model is the same, pass `value_head_init={was!r}` to resume."]


def check_resumable(saved: dict, current: dict, checkpoint: str) -> None:
    """Raise an error that names every difference between the saved and the current run identity that makes it
    another run; log the allowed setting changes, each with the value used."""
    differences = identity_differences(saved, current)
    _, allowed = config_changes(saved.get("config", {}), current["config"])
    allowed += prompts_changes(saved.get("train_dataset"), current.get("train_dataset"))[1]
    if allowed and not differences:
        logger.warning(f"Resuming from {checkpoint} with changed settings:\n  " + "\n  ".join(allowed))
    if differences:
        raise CheckpointOfOtherSettingsError(
            f"Cannot resume from {checkpoint}: it was written by a different run.\n  "
            + "\n  ".join(differences)
            + "\nResume with the same batch layout, seeds, models, prompts and learning-rate schedule, or start a new "
            "run in another `output_dir`."
        )

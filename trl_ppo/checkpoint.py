"""What exact resume needs beyond `transformers.Trainer`, and checkpoints that are never half-written.

A checkpoint folder `checkpoint-<update>` holds the policy (root, Hugging Face format), the value model
(`value_model/`), optimizer and scheduler states, one RNG file per process, `trainer_state.json`, and
`trl_ppo_state.json` (counters, data position, metrics not yet logged, and what must match to resume). It is
written under `tmp-checkpoint-<update>` and renamed into place only when complete, so a folder named
`checkpoint-*` is always whole.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import threading

import numpy as np
import torch

PPO_STATE_NAME = "trl_ppo_state.json"
CHECKPOINT_PREFIX = "checkpoint-"
STAGING_PREFIX = "tmp-checkpoint-"

# Settings that decide the shape of the run: resuming with another value cannot reproduce it.
MUST_MATCH = (
    "per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches", "world_size", "batch_size",
    "response_length", "seed",
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

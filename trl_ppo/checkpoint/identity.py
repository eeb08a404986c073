"""What must match between the run that wrote a checkpoint and the run that resumes it: the settings that
decide the shape of the run, and a fingerprint of each model it started from."""

from __future__ import annotations

import torch

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


def run_identity(args, fingerprints: dict) -> dict:
    """What must match between the run that wrote a checkpoint and the run that resumes it: the settings of
    `MUST_MATCH` and the initial models' `fingerprints` (`{"<role>_fingerprint": model_fingerprint(model)}`)."""
    return {**{name: getattr(args, name) for name in MUST_MATCH}, **fingerprints}


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

"""The random number generators of a process: captured at the start of each update, saved one file per process
in a checkpoint, restored on resume (python, numpy, torch CPU and CUDA)."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def capture_rng_state(cuda: bool = True) -> dict:
    """Every RNG this process draws from (python, numpy, torch CPU and, unless `cuda=False`, CUDA)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if cuda and torch.cuda.is_available():
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


def read_rng_file(folder: str, process_index: int) -> dict:
    """The per-process file of checkpoint `folder` as saved: the RNG states (and, with `max_staleness`, the sampler
    process's batches in flight)."""
    path = rng_file(folder, process_index)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: this checkpoint was written by a run with fewer processes.")
    try:  # the file holds numpy/python RNG tuples, which the safe loader does not know
        return torch.load(path, weights_only=False)
    except Exception as error:
        raise ValueError(f"{path} cannot be read ({type(error).__name__}: {error})") from None


def load_rng_state(folder: str, process_index: int) -> None:
    restore_rng_state(read_rng_file(folder, process_index))

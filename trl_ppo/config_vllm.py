"""`PPOConfig`'s fields of the 'vllm' generation backend (`rollout/vllm_engine.py`): how much memory its engine may
take, the longest sequence it serves, whether it compiles (mixed into it like `AsyncConfig`). What the engine
cannot run with yet is refused by `vllm_methods.check_engine_layout`, once the trainer knows its models."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from .rollout.vllm_engine import INSTALL_HINT


@dataclass
class VLLMConfig:
    """`vllm_gpu_memory_utilization`, `vllm_kv_cache_gib`, `vllm_max_model_len` and `vllm_enforce_eager`."""

    vllm_gpu_memory_utilization: float = field(
        default=0.3,
        metadata={
            "help": "With `generation_backend='vllm'`: the share of the device's memory the engine may take, its "
            "weights and KV cache together (TRL's name and default; on a CPU, the share of the machine's memory). "
            "The trainer's own models and optimizer need the rest."
        },
    )
    vllm_kv_cache_gib: float | None = field(
        default=None,
        metadata={
            "help": "With `generation_backend='vllm'`: the engine's KV cache in GiB, instead of what "
            "`vllm_gpu_memory_utilization` leaves for it. None: that share on CUDA, 1 GiB on a CPU (where vLLM "
            "counts the trainer's own memory against the share)."
        },
    )
    vllm_max_model_len: int | None = field(
        default=None,
        metadata={
            "help": "With `generation_backend='vllm'`: the longest prompt + response the engine serves (None: the "
            "model's context length). Smaller leaves room for more sequences in the same KV cache."
        },
    )
    vllm_enforce_eager: bool | None = field(
        default=None,
        metadata={
            "help": "With `generation_backend='vllm'`: True runs the engine eagerly (no CUDA graphs, no compilation: "
            "quicker to start, slower per token on a GPU). None: eager on a CPU, graphs on CUDA."
        },
    )


def check_vllm_options(args, fail) -> None:
    """The engine's fields, and that vLLM is installed, before any compute; `fail(message)` raises."""
    if not 0.0 < args.vllm_gpu_memory_utilization <= 1.0:
        fail(f"`vllm_gpu_memory_utilization` must be in (0, 1], got {args.vllm_gpu_memory_utilization}.")
    if args.vllm_kv_cache_gib is not None and not args.vllm_kv_cache_gib > 0:
        fail(f"`vllm_kv_cache_gib` must be > 0 (None: the default), got {args.vllm_kv_cache_gib}.")
    if args.vllm_max_model_len is not None and args.vllm_max_model_len < 1:
        fail(f"`vllm_max_model_len` must be at least 1 (None: the model's), got {args.vllm_max_model_len}.")
    if args.generation_backend == "vllm" and args.agent_rollout == "lockstep":
        fail(
            "`agent_rollout='lockstep'` samples the episodes with the trainer's own loop, and with "
            "`generation_backend='vllm'` the engine plays them (as requests, batched continuously): leave "
            "`agent_rollout` at 'continuous', or use generation_backend='kv_cache'."
        )
    if args.generation_backend == "vllm" and importlib.util.find_spec("vllm") is None:
        fail(f"`generation_backend='vllm'` needs vLLM, which is not installed here: {INSTALL_HINT}.")

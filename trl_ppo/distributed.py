"""Several processes, DeepSpeed and FSDP2: the process group, per-process seeds, DeepSpeed's batch layout, the
frozen models under ZeRO-3 and FSDP2 (`fsdp.py`), and the policy's weights gathered for sampling.

Everything here is a no-op in a single process without DeepSpeed, so the trainer calls it unconditionally.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch
from torch import nn

from . import fsdp
from .modules import freeze

# Process i samples with seed `seed + i * PROCESS_SEED_STRIDE`: the processes draw different responses to their
# different prompts, while the data order (seeded by `seed` alone) is the same everywhere. A large prime keeps the
# seeds of runs with neighbouring `seed` values apart.
PROCESS_SEED_STRIDE = 100003

T = TypeVar("T")


def process_seed(seed: int, process_index: int) -> int:
    return seed + process_index * PROCESS_SEED_STRIDE


def check_supported(
    args,
    deepspeed_enabled: bool,
    fsdp_version: int | None = None,
    zero_stage: int | None = None,
    shared_reference: bool = False,
) -> None:
    """Refuse, before any compute, what this trainer cannot do under the launch configuration.

    FSDP1: trl_ppo gathers and shards through FSDP2's per-module API (`fsdp.py`). Under ZeRO-3 or FSDP2, a reference
    that shares layers with the policy (`shared_reference`): both would shard them. Under DeepSpeed, the options
    that decide to skip an optimizer step after the gradients exist: DeepSpeed steps inside the backward of a
    minibatch's last micro-batch, before such a decision can be made."""
    if fsdp_version is not None and fsdp_version != 2:
        raise ValueError(
            f"FSDP version {fsdp_version} is not supported by trl_ppo: set `fsdp_version: 2` in the `fsdp_config` "
            "of the accelerate config (examples/accelerate_configs/fsdp2.yaml), or shard with DeepSpeed ZeRO-3 "
            "(examples/accelerate_configs/deepspeed_zero3.yaml)."
        )
    if shared_reference and (zero_stage == 3 or fsdp_version == 2):
        layout = "DeepSpeed ZeRO-3" if zero_stage == 3 else "FSDP2"
        raise ValueError(
            f"Under {layout} the reference cannot share layers with the policy (`create_reference_model(model, "
            "num_shared_layers=...)`): pass `num_shared_layers=None` or `ref_model=None`."
        )
    if not deepspeed_enabled:
        return
    asked = [
        name
        for name, value in (
            ("early_stopping", getattr(args, "early_stopping", False)),
            ("ratio_threshold", getattr(args, "ratio_threshold", None) is not None),
            ("skip_nonfinite_updates", args.skip_nonfinite_updates),
            ("skip_zero_gradient_steps", getattr(args, "skip_zero_gradient_steps", False)),
            ("critic_warmup_steps", getattr(args, "critic_warmup_steps", 0) > 0),
        )
        if value
    ]
    if asked:
        raise ValueError(
            f"{', '.join(f'`{name}`' for name in asked)} cannot be used under DeepSpeed: it steps the optimizer inside "
            "the backward pass, before the minibatch could be skipped or the policy's gradients dropped. Turn the "
            "option off, or train without DeepSpeed (one process or DDP)."
        )


def process_group_kwargs(ddp_backend: str | None, ddp_timeout: int | None):
    """The `InitProcessGroupKwargs` handler that makes `Accelerator` use `--ddp_backend` (e.g. gloo for DeepSpeed on
    CPU, where DeepSpeed would otherwise set up its own group) and `--ddp_timeout`; None when neither is set."""
    from accelerate.utils import InitProcessGroupKwargs

    kwargs = {}
    if ddp_backend is not None:
        kwargs["backend"] = ddp_backend
    if ddp_timeout is not None:
        kwargs["timeout"] = timedelta(seconds=ddp_timeout)
    return InitProcessGroupKwargs(**kwargs) if kwargs else None


def deepspeed_zero_stage(accelerator) -> int | None:
    """The ZeRO stage of the run, or None without DeepSpeed."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return None if plugin is None else int(plugin.zero_stage)


def fit_deepspeed_batch_layout(accelerator, train_forward_batch_size: int, local_mini_batch_size: int) -> None:
    """Tell DeepSpeed how many backward passes make one optimizer step: those of one PPO minibatch,
    `local_mini_batch_size / train_forward_batch_size` (by default `gradient_accumulation_steps / num_mini_batches`),
    not `gradient_accumulation_steps` as in supervised training. DeepSpeed divides the loss by this count and steps
    at its boundary."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    passes_per_step = -(-local_mini_batch_size // train_forward_batch_size)  # the last pass may be smaller
    config = plugin.deepspeed_config
    config["train_micro_batch_size_per_gpu"] = train_forward_batch_size
    config["gradient_accumulation_steps"] = passes_per_step
    config["train_batch_size"] = train_forward_batch_size * passes_per_step * accelerator.num_processes


def prepare_frozen_model(model: nn.Module, accelerator) -> tuple[nn.Module, object | None]:
    """Place a frozen model (reference, reward) for inference -> (the module to call, the engine to keep alive).

    Under ZeRO-3 it is partitioned like the policy by an inference-only DeepSpeed engine (no optimizer), whose hooks
    gather each layer's weights when it runs; the module itself stays callable, submodules included. Under FSDP2 it
    is sharded into units (`fsdp.shard_frozen_model`; call its parts through `fsdp.root_call`). Otherwise (ZeRO
    stages 0-2, DDP, one process) it is copied whole to the device: it has no gradients or optimizer state to shard.
    """
    if fsdp.is_fsdp2(accelerator):
        return fsdp.shard_frozen_model(model, accelerator), None
    stage = deepspeed_zero_stage(accelerator)
    if stage != 3:
        model = model.to(accelerator.device)
        dtype = None if stage is None else deepspeed_weights_dtype(accelerator)
        if dtype is not None:  # as DeepSpeed does to the policy: parameters only, buffers (rotary...) stay fp32
            for parameter in model.parameters():
                if parameter.is_floating_point():
                    parameter.data = parameter.data.to(dtype)
        elif stage is None and accelerator.mixed_precision == "bf16":
            # Autocast runs every linear layer in bf16, casting its fp32 weights at each call: storing them in bf16
            # computes the same numbers with half the memory and no casts. Other weights (embeddings, norms) run
            # in fp32 under autocast, so they stay fp32, and the reference still matches the policy exactly.
            for module in model.modules():
                if isinstance(module, nn.Linear):
                    module.to(torch.bfloat16)
        return model, None
    import deepspeed

    config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    zero = config.setdefault("zero_optimization", {})
    hidden_size = _hidden_size(model)
    if hidden_size is not None:  # DeepSpeed's own sizing rule for the buckets a user left to "auto"
        for key, value in (
            ("reduce_bucket_size", hidden_size * hidden_size),
            ("stage3_prefetch_bucket_size", int(0.9 * hidden_size * hidden_size)),
            ("stage3_param_persistence_threshold", 10 * hidden_size),
        ):
            if zero.get(key, "auto") == "auto":
                zero[key] = value
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine.module, engine


def place_frozen_models(ref_model: nn.Module | None, rewards: list, accelerator) -> tuple[nn.Module | None, list]:
    """Place the frozen reference and reward models for inference (`prepare_frozen_model`, after `freeze`): the
    reward models in place (`reward.source`) -> (the reference, the ZeRO-3 engines whose hooks they need)."""

    engines = []

    def place(model: nn.Module) -> nn.Module:
        module, engine = prepare_frozen_model(freeze(model), accelerator)
        engines.extend([engine] if engine is not None else [])
        return module

    for reward in rewards:
        if reward.is_model:
            reward.source = place(reward.source)
    return (None if ref_model is None else place(ref_model)), engines


def deepspeed_weights_dtype(accelerator) -> torch.dtype | None:
    """The dtype DeepSpeed keeps the trained weights in (bf16 / fp16 when enabled in its config), else None."""
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if config.get(key, {}).get("enabled") is True:
            return dtype
    return None


def assert_consistent_across_processes(value: int, device: torch.device, message: str) -> None:
    """Raise `ValueError(message)` on every process when `value` differs between processes (so that no process is
    left waiting in a collective that the others skip)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    bounds = torch.tensor([value, -value], device=device)
    torch.distributed.all_reduce(bounds, op=torch.distributed.ReduceOp.MAX)
    if int(bounds[0]) != -int(bounds[1]):
        raise ValueError(message)


def _hidden_size(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    for key in ("hidden_size", "hidden_sizes", "d_model", "n_embd"):
        value = getattr(config, key, None)
        if value is not None:
            return max(value) if isinstance(value, (list, tuple)) else int(value)
    return None


@contextlib.contextmanager
def gathered_for_generation(engine: nn.Module, wrapper: nn.Module, accelerator, gather: bool = True):
    """While sampling: under ZeRO-3 with `gather=True`, the policy's partitioned weights gathered once on every
    process for the whole rollout, and ZeRO-3's per-layer hooks taken off meanwhile (left on, they would release
    and gather every layer again at each sampled token); under FSDP2 likewise, every unit of the wrapper unsharded
    and kept so (`fsdp.gathered`). Elsewhere nothing happens.

    `engine` is the prepared DeepSpeed engine, `wrapper` the module it trains (`PolicyAndValueWrapper`)."""
    if fsdp.is_fsdp2(accelerator) and gather:
        with fsdp.gathered(wrapper, wrapper.lm):
            yield
        return
    if deepspeed_zero_stage(accelerator) != 3 or not gather:
        yield
        return
    import deepspeed

    offload = engine.optimizer.parameter_offload  # the ZeRO-3 optimizer's owner of the hooks
    with deepspeed.zero.GatheredParameters(list(wrapper.lm.parameters())):
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            offload._register_deepspeed_module(offload.module)


def weights_are_sharded(accelerator) -> bool:
    """Whether the policy's weights are sharded over the processes (ZeRO-3, FSDP2): then each sampling call gathers
    them (or each forward does), a collective that every process must make as often as the others."""
    return deepspeed_zero_stage(accelerator) == 3 or fsdp.is_fsdp2(accelerator)


def sampling_needs_sync(accelerator, gather: bool) -> bool:
    """Whether every process must run the same number of forwards while sampling: under ZeRO-3 or FSDP2 without
    gathered weights each forward is a collective, so a process whose responses all stopped keeps stepping with
    the others."""
    return weights_are_sharded(accelerator) and not gather and accelerator.num_processes > 1


def checked_on_every_process(
    check: Callable[[], T],
    device: torch.device,
    what: str,
    catch: tuple[type[Exception], ...] = (ValueError, TypeError),
    failed: str = "were refused",
    error_type: type[Exception] = ValueError,
) -> T:
    """`check()`'s result, once it passed on every process. A check of this process's own inputs (`step()`'s
    episodes, `generate()`'s queries), or a call into user code (a reward function, environments' `reset`), may
    fail on one process only: then every process raises, so that none is left waiting in the next collective for
    one that stopped. The failing process raises its own error (one of `catch`), the others an `error_type`
    saying that another process's `what` `failed`."""
    try:
        result, error = check(), None
    except catch as raised:
        result, error = None, raised
    passed = all_processes(error is None, device)
    if error is not None:
        raise error
    if not passed:
        raise error_type(f"Another process's {what} {failed} (its error says why); this process stops too.")
    return result


def max_over_processes(value: int, device: torch.device) -> int:
    """The largest `value` of all processes (`value` itself without a process group)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    largest = torch.tensor([value], device=device)
    torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX)
    return int(largest.item())


def all_processes(flag: bool, device: torch.device) -> bool:
    """True when `flag` holds on every process (a one-element all-reduce; `flag` itself without a process group)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return flag
    value = torch.tensor([1 if flag else 0], device=device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN)
    return bool(value.item())

"""FSDP2 (`torch.distributed.fsdp.fully_shard`, accelerate's `fsdp_version: 2`): which FSDP a run uses, the
frozen models (reference, reward models) sharded like the trained ones, calls that run a sharded model's parts (its
backbone, its head) outside its `forward`, and the policy's weights gathered once for a whole rollout's sampling.

Accelerate shards the trained `PolicyAndValueWrapper` itself (`accelerator.prepare`: one unit per transformer block,
the rest in the root unit). FSDP gathers a unit's weights in that unit's forward hooks; the root's own weights
(embeddings, heads) are therefore gathered only while the root's `forward` runs. trl_ppo calls a model's backbone
and head one by one (chunked log-probs, the sampling loop, the scalar heads): such calls go through `root_call`,
which runs them as a forward of the root.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Callable

from torch import nn

from .modules import decoder_blocks

ROOT_CALL = "trl_ppo_root_call"  # the forward method `enable_root_calls` registers on a sharded root


def fsdp_version(accelerator) -> int | None:
    """The FSDP version of the run (1 or 2), or None without FSDP."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    return None if plugin is None else int(getattr(plugin, "fsdp_version", 1))


def is_fsdp2(accelerator) -> bool:
    return fsdp_version(accelerator) == 2


def check_settings(accelerator) -> None:
    """Refuse, before any compute, the FSDP2 settings trl_ppo cannot run with."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if fsdp_version(accelerator) == 2 and getattr(plugin, "cpu_ram_efficient_loading", False):
        raise ValueError(
            "`fsdp_cpu_ram_efficient_loading: true` is not supported by trl_ppo: the processes other than the first "
            "then load the policy without its weights, and the reference copied from it would have none. Set it to "
            "false in the accelerate config's `fsdp_config` (examples/accelerate_configs/fsdp2.yaml)."
        )


def keep_float32_outputs(accelerator) -> None:
    """Under FSDP2 with mixed precision, let sharded roots return their outputs as computed: accelerate's policy casts
    them to the compute dtype (`output_dtype`), which would round the float32 log-probs and values of the wrapper
    and of the reference to bf16 (and the PPO ratio with them). Call before `accelerator.prepare`."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    policy = getattr(plugin, "mixed_precision_policy", None)
    if fsdp_version(accelerator) == 2 and getattr(policy, "output_dtype", None) is not None:
        plugin.mixed_precision_policy = dataclasses.replace(policy, output_dtype=None)


def _call(self: nn.Module, function: Callable, *args, **kwargs):
    return function(self, *args, **kwargs)


def enable_root_calls(module: nn.Module) -> None:
    """Let `root_call(module, ...)` run as a forward of `module`, an FSDP2 root (nothing for another module)."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    if isinstance(module, FSDPModule) and not hasattr(module, ROOT_CALL):
        setattr(module, ROOT_CALL, types.MethodType(_call, module))
        register_fsdp_forward_method(module, ROOT_CALL)


def root_call(module: nn.Module, function: Callable, *args, **kwargs):
    """`function(module, *args, **kwargs)`; for an FSDP2 root (`enable_root_calls`), as its forward: the root's own
    weights are gathered meanwhile (and its units' weights, each as it runs). On every process: a collective."""
    call = getattr(module, ROOT_CALL, None)
    return function(module, *args, **kwargs) if call is None else call(function, *args, **kwargs)


def shard_frozen_model(model: nn.Module, accelerator) -> nn.Module:
    """A frozen model (the reference, a reward model) sharded like accelerate shards the trained ones: one FSDP2 unit
    per transformer block, the rest in the root, with the run's mixed precision and offloading; each unit's weights
    are gathered for its forward and freed after it. The root accepts `root_call`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


    plugin = accelerator.state.fsdp_plugin
    options = {
        "reshard_after_forward": True,
        "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
        "offload_policy": plugin.cpu_offload,
    }
    model.to(accelerator.device)
    for block in decoder_blocks(model):
        fully_shard(block, **options)
    fully_shard(model, **options)
    enable_root_calls(model)
    return model


def _units(module: nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [unit for unit in module.modules() if isinstance(unit, FSDPModule)]


def _reshards_after_forward(unit) -> bool:
    # FSDP2 keeps the setting per parameter group, as the mesh to reshard to after forward (None: keep unsharded);
    # there is no public getter.
    return any(group.post_forward_mesh_info is not None for group in unit._get_fsdp_state()._fsdp_param_groups)


@contextlib.contextmanager
def gathered(root: nn.Module, part: nn.Module):
    """The FSDP2 units of `part` (the policy's LM inside the wrapper `root`) and `root`'s own unit unsharded at once,
    and kept so through any number of forwards (sampling runs one per token: each would otherwise gather and free
    every block again); resharded after, each unit's `reshard_after_forward` as it was. The other units (the value
    model's) stay sharded. A collective: on every process."""
    root_call(root, lambda _: None)  # FSDP takes the first unit to run a forward as the root: let it be `root`
    units = [root, *(unit for unit in _units(part) if unit is not root)]
    settings = [(unit, _reshards_after_forward(unit)) for unit in units]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit, reshard in settings:
            unit.reshard()
            unit.set_reshard_after_forward(reshard, recurse=False)

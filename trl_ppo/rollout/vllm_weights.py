"""The weights a vLLM engine is pushed: the policy's, under its checkpoint names (its `state_dict`'s, what vLLM's
loaders expect), by reference. A PEFT (LoRA) policy's are its base model's with each LoRA layer's active adapters
merged in, out of place: the engine samples the policy the update trains (adapter on), the policy's own weights
are not touched (merging in place and back would round the base weights a little at every push), and the engine
needs no LoRA support of its own. What cannot be merged that way (DoRA, other PEFT methods, `modules_to_save`) is
refused before any compute (`adapter_refusal`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..models import causal_lm, is_peft_model


def adapter_refusal(policy: nn.Module) -> str | None:
    """Why the 'vllm' backend cannot take `policy`'s adapters (None: it can, or it has none)."""
    if not is_peft_model(policy):
        return None
    for name, config in causal_lm(policy).peft_config.items():
        kind = str(getattr(config.peft_type, "value", config.peft_type))
        if kind != "LORA":
            return f"takes LoRA adapters only (merged into the weights it is pushed), and adapter {name!r} is {kind}"
        if getattr(config, "use_dora", False):
            return f"merges LoRA adapters as W + BA, and adapter {name!r} is DoRA (its magnitude vector is not merged)"
        if getattr(config, "modules_to_save", None):
            return f"merges LoRA adapters only, and adapter {name!r} also trains whole modules (`modules_to_save`)"
    return None


@torch.no_grad()
def checkpoint_weights(policy: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight for the engine (see the module): detached views, except the merged LoRA
    layers' (new tensors, W + the active adapters' delta)."""
    if not is_peft_model(policy):
        for name, tensor in policy.state_dict().items():
            yield name, tensor.detach()
        return
    base = causal_lm(policy).get_base_model()
    deltas = dict(_lora_deltas(base))
    for name, tensor in base.state_dict().items():
        if ".lora_" in name:  # the adapters' own tensors: merged below
            continue
        name = name.replace(".base_layer.", ".")
        yield name, (tensor + deltas[name].to(tensor.dtype)) if name in deltas else tensor.detach()


def _lora_deltas(base: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """(the weight's name, the sum of the active adapters' delta weights) of each LoRA layer with adapters on."""
    from peft.tuners.lora import LoraLayer

    for name, module in base.named_modules():
        if not isinstance(module, LoraLayer) or module.merged or module.disable_adapters:
            continue
        active = [adapter for adapter in module.active_adapters if adapter in module.lora_A]
        if active:
            yield f"{name}.weight", sum(module.get_delta_weight(adapter) for adapter in active)

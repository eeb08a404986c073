"""Helpers over plain `nn.Module` trees that the model, sharding and placement code all use (kept apart from
`models.py` so that `distributed.py` and `fsdp.py` need not import it)."""

from __future__ import annotations

from torch import nn


def freeze(model: nn.Module) -> nn.Module:
    """Put a model that is only read (reference, reward) in eval mode without gradients."""
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model



def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's stack of transformer blocks: its longest `nn.ModuleList`."""
    stacks = [module for module in model.modules() if isinstance(module, nn.ModuleList)]
    if not stacks:
        raise ValueError(f"Cannot find the transformer blocks of {type(model).__name__} (no nn.ModuleList).")
    return max(stacks, key=len)

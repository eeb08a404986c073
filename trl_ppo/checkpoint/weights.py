"""The trained models' weights: checked finite before any write, and loaded back from a checkpoint into the
models of a resumed run."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable

import torch

from ..models import PreparedModels
from ..value_head import VALUE_HEAD_FILE, is_value_head_model


def nonfinite_tensor(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first floating-point tensor holding NaN or infinity, or None. Under ZeRO-3 a parameter is
    an empty placeholder and this process's partition is its `ds_tensor`; under FSDP2 a parameter is a `DTensor`,
    this process's shard its local tensor; offloaded (meta) tensors hold nothing."""
    for name, tensor in named_tensors:
        tensor = getattr(tensor, "ds_tensor", tensor)
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if tensor.device.type == "meta" or not tensor.is_floating_point():
            continue
        if not torch.isfinite(tensor.detach()).all():
            return name
    return None


def named_weights(module: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of `module`, by name (what its `state_dict` holds)."""
    yield from module.named_parameters()
    yield from module.named_buffers()


def load_trained_weights(path: str, models: PreparedModels) -> None:
    """The policy's and the value model's weights of checkpoint `path` into `models`; under DeepSpeed, each
    process's partition of the weights and optimizer state (DeepSpeed's own `global_step*/` files); under FSDP2,
    each process's shard of the weights that `Trainer` wrote beside the optimizer (`pytorch_model_fsdp*`, whole or
    sharded as the accelerate config's `fsdp_state_dict_type` says). A collective there."""
    if models.is_deepspeed:
        from transformers.integrations.deepspeed import deepspeed_load_checkpoint

        deepspeed_load_checkpoint(models.model, path)
        return
    if models.is_fsdp2:
        from accelerate.utils import load_fsdp_model

        load_fsdp_model(models.accelerator.state.fsdp_plugin, models.accelerator, models.model, path)
        return
    load_weights_into(models.wrapper.policy, path)
    if models.wrapper.value_model is not None:
        load_weights_into(models.wrapper.value_model, os.path.join(path, "value_model"))


def has_deepspeed_state(path: str) -> bool:
    return bool(glob.glob(os.path.join(path, "global_step*")))


def has_fsdp_state(path: str) -> bool:
    return bool(glob.glob(os.path.join(path, "pytorch_model_fsdp*")))


def checkpoint_layout(path: str) -> str | None:
    """How checkpoint `path` holds its trained weights and optimizer: "DeepSpeed", "FSDP" or None (plain)."""
    return "DeepSpeed" if has_deepspeed_state(path) else "FSDP" if has_fsdp_state(path) else None


def load_weights_into(model: torch.nn.Module, folder: str) -> None:
    """Load weights written by `save_pretrained` (a PEFT adapter, or a full model) into `model` in place.

    A full model is read back through its class's `from_pretrained`, which knows how the saved names map onto
    the in-memory ones (they differ for some architectures); this holds a second copy in CPU memory for a moment.
    It is built from `model`'s own config, never from a default one: the saved weights must fit the live model.
    """
    from safetensors.torch import load_file

    if is_value_head_model(model):  # the causal LM as below, then its head
        load_weights_into(model.pretrained_model, folder)
        if not model.load_value_head(folder):
            raise FileNotFoundError(f"{folder} has no {VALUE_HEAD_FILE}: it was not written by a value-head policy.")
        return
    adapter = os.path.join(folder, "adapter_model.safetensors")
    if os.path.isfile(adapter):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(adapter))
        return
    dtype = next(model.parameters()).dtype
    saved = type(model).from_pretrained(folder, config=model.config, dtype=dtype)
    model.load_state_dict(saved.state_dict(), strict=True)
    del saved

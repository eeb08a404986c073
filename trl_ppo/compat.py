"""Names that differ between the transformers releases trl_ppo admits (pyproject: >= 5.3), each chosen by looking at
what the installed release has, never by version number: newer releases renamed `past_key_values` to `cache` (the
old name warns, and goes in 5.40) and `gradient_checkpointing` to `activation_checkpointing` (goes in v6)."""

from __future__ import annotations

import dataclasses
import inspect

from transformers import TrainingArguments
from transformers.modeling_outputs import CausalLMOutputWithPast

# The keyword of the KV cache in `generate()` and in this release's own models (5.3: `past_key_values`).
CACHE_KEYWORD = (
    "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"
)
# The `TrainingArguments` field that turns activation (gradient) checkpointing on.
CHECKPOINTING_FIELD = (
    "activation_checkpointing"
    if "activation_checkpointing" in {f.name for f in dataclasses.fields(TrainingArguments)}
    else "gradient_checkpointing"
)


def cache_keyword(model) -> str:
    """The keyword `model`'s forward takes its KV cache under: its own signature's name (a model with remote code
    may keep the old one), else this release's (a PEFT wrapper passes `**kwargs` on to the model it wraps)."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return CACHE_KEYWORD
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    return CACHE_KEYWORD


def returned_cache(output):
    """The KV cache a forward returned, or None: `output.cache`, or `output.past_key_values` before the rename
    (reading the old name where the new one exists warns)."""
    return getattr(output, CACHE_KEYWORD, None)


def enable_activation_checkpointing(model, kwargs: dict | None) -> None:
    """Turn on activation checkpointing of a transformers model (PEFT-wrapped or not) through the method this
    release names for it."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

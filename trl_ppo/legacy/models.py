"""The model surface that scripts for trl <= 0.11 use: `AutoModelForCausalLMWithValueHead` whose forward returns
the tuple `(lm_logits, loss, value)`, saved and loaded with the head's `v_head.*` weights inside the model's own
weights file as trl 0.11 did; and `create_reference_model`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .. import models as core_models
from ..compat import cache_keyword, returned_cache
from .. import value_head as core


class ValueHeadOutput(NamedTuple):
    """trl 0.11's forward output: unpacks as `lm_logits, loss, value` (logits float32 `[B, L, V]`, values
    `[B, L]`); the trainer reads the same fields by name."""

    logits: torch.Tensor
    loss: torch.Tensor | None
    value: torch.Tensor


class ValueHeadOutputWithPast(NamedTuple):
    """With `return_past_key_values=True`: `lm_logits, loss, value, past_key_values`."""

    logits: torch.Tensor
    loss: torch.Tensor | None
    value: torch.Tensor
    past_key_values: object


# `from_pretrained` kwargs of trl 0.11 that shape the value head rather than the causal LM.
_HEAD_KWARGS = ("summary_dropout_prob", "v_head_initializer_range", "v_head_init_strategy")


class AutoModelForCausalLMWithValueHead(core.AutoModelForCausalLMWithValueHead):
    """trl_ppo's causal LM with a value head (`pretrained_model`, `v_head.summary`), with trl 0.11's forward
    and save format. Dropout in the head (`summary_dropout_prob`) is not applied: PPO needs a deterministic
    forward, and the trainer turns dropout off everywhere."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """A hub name, a local folder (also one written by trl 0.11, whose `v_head.*` weights are read), or a
        causal LM. `v_head_init_strategy="normal"` with `v_head_initializer_range` (default 0.2) initialises a
        new head from N(0, range) as trl 0.11 did; other kwargs go to `AutoModelForCausalLM.from_pretrained`."""
        head_kwargs = {name: kwargs.pop(name) for name in _HEAD_KWARGS if name in kwargs}
        if kwargs.pop("reward_adapter", None) is not None:
            raise ValueError("`reward_adapter` is not supported by trl_ppo: score with a reward model or function.")
        model = super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        strategy = head_kwargs.get("v_head_init_strategy")
        if strategy not in (None, "normal"):
            raise ValueError(f"`v_head_init_strategy` must be None or 'normal', got {strategy!r}.")
        if not model.has_loaded_head:
            # A new head starts the same every time (trl 0.11's was random), so that a script restarted from the
            # same model can resume its checkpoints, which check that the initial models match.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                if strategy == "normal":
                    nn.init.normal_(model.v_head.summary.weight, std=head_kwargs.get("v_head_initializer_range", 0.2))
                    nn.init.zeros_(model.v_head.summary.bias)
                else:
                    model.v_head.reset_parameters()
        return model

    @property
    def is_peft_model(self) -> bool:
        return core_models.is_peft_model(self)

    def load_value_head(self, source: str, revision: str | None = None) -> bool:
        self.has_loaded_head = super().load_value_head(source, revision)
        return self.has_loaded_head

    def forward(
        self, input_ids=None, past_key_values=None, attention_mask=None, return_past_key_values=False, **kwargs
    ):
        """The LM's forward and the value of every position -> `(lm_logits, loss, value)` (and
        `past_key_values` when `return_past_key_values`)."""
        if past_key_values is not None:  # under the name this transformers release's models take
            kwargs[cache_keyword(self.pretrained_model)] = past_key_values
        output = super().forward(input_ids, attention_mask, **kwargs)
        logits = output.logits.float()  # trl 0.11 upcast half-precision logits
        if return_past_key_values:
            return ValueHeadOutputWithPast(logits, output.loss, output.value, returned_cache(output))
        return ValueHeadOutput(logits, output.loss, output.value)

    def trl011_state_dict(self) -> dict:
        """The causal LM's weights and the head's as `v_head.*` (only the head's under PEFT): what trl 0.11's
        `state_dict()` gave and saved. (`state_dict()` itself stays `nn.Module`'s, which the trainer relies on.)"""
        lm_state = {} if self.is_peft_model else self.pretrained_model.state_dict()
        lm_state.update({f"v_head.{key}": value for key, value in self.v_head.state_dict().items()})
        return lm_state

    def save_pretrained(self, save_directory: str, state_dict: dict | None = None, **kwargs) -> None:
        """trl 0.11's format: the causal LM's files with the head's `v_head.*` weights in the same weights file,
        so that trl 0.11, this class and `AutoModelForCausalLM` (which ignores those keys) all load it. Under
        PEFT: the adapter, and the head in `value_head.safetensors`."""
        if self.is_peft_model:
            super().save_pretrained(save_directory, state_dict=state_dict, **kwargs)
            return
        state_dict = self.trl011_state_dict() if state_dict is None else state_dict
        self.pretrained_model.save_pretrained(save_directory, state_dict=state_dict, **kwargs)

    def compute_reward_score(self, input_ids, attention_mask=None, **kwargs) -> torch.Tensor:
        """trl 0.11 scored with a PEFT reward adapter here (`from_pretrained(..., reward_adapter=...)`), which
        trl_ppo does not load: use a reward model, or a reward function, to score."""
        raise ValueError(
            "This model does not support reward modeling adapter: trl_ppo does not load `reward_adapter`. Score "
            "with a reward model (`AutoModelForSequenceClassification`) or a function instead."
        )

    def push_to_hub(self, *args, **kwargs):
        """Push the causal LM with the head's weights in its files (trl 0.11's format)."""
        return self.pretrained_model.push_to_hub(*args, state_dict=self.trl011_state_dict(), **kwargs)


AutoModelForCausalLMWithValueHead.has_loaded_head = False  # until `load_value_head` finds a saved head


def create_reference_model(model: nn.Module, num_shared_layers: int | None = None, pattern: str | None = None):
    """A frozen copy of `model` to serve as the reference. With `num_shared_layers`, the embeddings and the first
    `num_shared_layers` transformer blocks are shared with `model` and frozen there (trl 0.11's meaning).
    `pattern` (trl 0.11's layer-name pattern) is not needed: the blocks are found in the model."""
    if pattern is not None:
        raise ValueError("`pattern` is not supported by trl_ppo: the transformer blocks are found automatically.")
    return core_models.create_reference_model(model, num_shared_layers)

"""The model surface that scripts for trl <= 0.11 use: `AutoModelForCausalLMWithValueHead` whose forward returns
the tuple `(lm_logits, loss, value)`, whose `state_dict()` has trl 0.11's keys, saved and loaded with the head's
`v_head.*` weights inside the model's own weights file as trl 0.11 did, with an optional reward adapter; and
`create_reference_model`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import torch
from torch import nn

from .. import models as core_models
from .. import value_head as core
from ..compat import cache_keyword, returned_cache
from .reward_adapter import load_reward_adapter, reward_scores


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

    rm_adapter_name: str | None = None  # with a reward adapter; its head is the submodule `score`
    policy_adapter_name = "default"

    def __init__(self, pretrained_model: nn.Module) -> None:
        super().__init__(pretrained_model)
        self.register_load_state_dict_pre_hook(_accept_trl011_keys)

    @property
    def supports_rm_adapter(self) -> bool:
        return "score" in self._modules

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """A hub name, a local folder (also one written by trl 0.11, whose `v_head.*` weights are read), or a
        causal LM. A new head starts as trl 0.11's did (seeded here): `v_head_init_strategy=None`, `nn.Linear`'s
        own init; `"normal"` with `v_head_initializer_range` (default 0.2), weights with that std and bias 0.
        `reward_adapter` (with `peft_config`, or a PEFT model): a reward model's adapter loaded beside the policy's,
        as `reward_adapter_name` (`compute_reward_score`). Other kwargs go to `AutoModelForCausalLM.from_pretrained`."""
        head_kwargs = {name: kwargs.pop(name) for name in _HEAD_KWARGS if name in kwargs}
        reward_adapter = kwargs.pop("reward_adapter", None)
        reward_adapter_name = kwargs.pop("reward_adapter_name", "reward_adapter")
        model = super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        if reward_adapter is not None:
            if not model.is_peft_model:
                raise ValueError(
                    "`reward_adapter` can only be used with a PEFT policy: pass `peft_config` (or a `PeftModel`), "
                    "so that the reward adapter sits beside the policy's adapter on the same backbone."
                )
            model.score = load_reward_adapter(model.pretrained_model, reward_adapter, reward_adapter_name)
            model.rm_adapter_name = reward_adapter_name
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
                else:  # trl 0.11 left `nn.Linear`'s own init: weight and bias uniform in ±1/sqrt(H)
                    model.v_head.summary.reset_parameters()
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

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """trl 0.11's keys: the causal LM's own names (`transformer.wte.weight`, without `pretrained_model.`), the
        head's as `v_head.*` (and a reward adapter's head as `score.*`). `load_state_dict` takes these and
        `nn.Module`'s `pretrained_model.*` names alike. (Under PEFT trl 0.11 gave the head's weights alone; here
        the PEFT model's, adapters included, so that the dict loads back.)"""
        if args:  # `nn.Module`'s old positional form: (destination, prefix, keep_vars)
            destination, prefix, keep_vars = (*args, *(destination, prefix, keep_vars)[len(args) :])
        if destination is None:
            destination = OrderedDict()
            destination._metadata = OrderedDict()
        for name, module in self.named_children():
            own_prefix = prefix if name == "pretrained_model" else f"{prefix}{name}."
            module.state_dict(destination=destination, prefix=own_prefix, keep_vars=keep_vars)
        return destination

    def post_init(self, state_dict: dict) -> None:
        """trl 0.11's hook after loading: the head's weights from the `v_head.*` entries of `state_dict`."""
        self.v_head.load_state_dict(core.sub_state_dict(state_dict, "v_head."))

    def save_pretrained(self, save_directory: str, state_dict: dict | None = None, **kwargs) -> None:
        """trl 0.11's format: the causal LM's files with the head's `v_head.*` weights in the same weights file,
        so that trl 0.11, this class and `AutoModelForCausalLM` (which ignores those keys) all load it. Under
        PEFT: the adapter, and the head in `value_head.safetensors`. `save_directory` must not be a file."""
        core.check_save_directory(save_directory)
        if state_dict is not None:  # given (gathered by DeepSpeed) in either layout: in the module's names
            state_dict = {_module_key(key, set(self._modules)): value for key, value in state_dict.items()}
        if self.is_peft_model:
            super().save_pretrained(save_directory, state_dict=state_dict, **kwargs)
            return
        state_dict = self.state_dict() if state_dict is None else state_dict
        state_dict = {key.removeprefix("pretrained_model."): value for key, value in state_dict.items()}
        self.pretrained_model.save_pretrained(save_directory, state_dict=state_dict, **kwargs)

    def compute_reward_score(self, input_ids, attention_mask=None, ppo_adapter_name: str | None = None, **kwargs):
        """Reward scores `[B, L, num_labels]` of every position (take the last real token's), computed with the
        reward adapter of `from_pretrained(..., reward_adapter=...)` switched on, no gradients; the policy's
        adapter (`ppo_adapter_name`, default "default") is active again afterwards."""
        if not self.supports_rm_adapter:
            raise ValueError(
                "This model does not support reward modeling adapter: load it with "
                "`AutoModelForCausalLMWithValueHead.from_pretrained(..., peft_config=..., reward_adapter=<folder>)`."
            )
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, **kwargs}
        policy_adapter = ppo_adapter_name or self.policy_adapter_name
        return reward_scores(self.pretrained_model, self.score, self.rm_adapter_name, policy_adapter, inputs)

    def push_to_hub(self, *args, **kwargs):
        """Push the causal LM with the head's weights in its files (trl 0.11's format)."""
        return self.pretrained_model.push_to_hub(*args, state_dict=self.state_dict(), **kwargs)


def _module_key(key: str, children: set[str]) -> str:
    """A `state_dict` key in `nn.Module`'s names: one of trl 0.11's layout (the causal LM's own name) gets
    `pretrained_model.` in front; those of the model's `children` (`v_head`, `score`, `pretrained_model`) stay."""
    return key if key.split(".", 1)[0] in children else f"pretrained_model.{key}"


def _accept_trl011_keys(module, state_dict, prefix, *args) -> None:
    """`load_state_dict` pre-hook: the keys under `prefix` renamed in place by `_module_key`."""
    children = set(module._modules)
    for key in [key for key in state_dict if key.startswith(prefix)]:
        renamed = prefix + _module_key(key[len(prefix) :], children)
        if renamed != key:
            state_dict[renamed] = state_dict.pop(key)


AutoModelForCausalLMWithValueHead.has_loaded_head = False  # until `load_value_head` finds a saved head


def create_reference_model(model: nn.Module, num_shared_layers: int | None = None, pattern: str | None = None):
    """A frozen copy of `model` to serve as the reference. With `num_shared_layers`, the embeddings and the first
    `num_shared_layers` transformer blocks are shared with `model` and frozen there (trl 0.11's meaning).
    `pattern` (trl 0.11's layer-name pattern) is not needed: the blocks are found in the model."""
    if pattern is not None:
        raise ValueError("`pattern` is not supported by trl_ppo: the transformer blocks are found automatically.")
    return core_models.create_reference_model(model, num_shared_layers)

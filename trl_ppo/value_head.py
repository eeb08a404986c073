"""A causal LM with a scalar value head on its own backbone: policy and value function in one model.

With `PPOTrainer(..., value_model=None)` the policy is wrapped in `AutoModelForCausalLMWithValueHead`, so one
forward pass gives both the next-token logits and the values, and no second backbone is held in memory.
The head reads the final hidden state (the input of the LM head), captured with a forward hook, so the
model's own logit computation (scaling, soft-capping, `logits_to_keep`) is untouched and no
`output_hidden_states` over all layers is needed.
"""

from __future__ import annotations

import os
from dataclasses import field, make_dataclass

import torch
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.utils import ModelOutput, logging

from .compat import CACHE_KEYWORD, enable_activation_checkpointing, returned_cache

logger = logging.get_logger(__name__)

VALUE_HEAD_FILE = "value_head.safetensors"
VALUE_HEAD_INITS = ("zeros", "normal")  # `ValueHead.reset_parameters`, `PPOConfig.value_head_init`


class ValueHead(nn.Module):
    """hidden `[..., H]` -> value `[...]`: one linear layer, initialised with std 1/sqrt(H + 1) and zero bias
    (the reward/value head initialisation of the original RLHF code)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.summary = nn.Linear(hidden_size, 1)
        self.reset_parameters()

    def reset_parameters(self, init: str = "normal") -> None:
        """`init="normal"`: weights from N(0, 1/(H+1)); `"zeros"`: every value 0 until the head learns. Bias 0."""
        if init not in VALUE_HEAD_INITS:
            raise ValueError(f"Unknown value head init {init!r}: use one of {VALUE_HEAD_INITS}.")
        if init == "zeros":
            nn.init.zeros_(self.summary.weight)
        else:
            nn.init.normal_(self.summary.weight, std=1.0 / (self.summary.in_features + 1) ** 0.5)
        nn.init.zeros_(self.summary.bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states.to(self.summary.weight.dtype)
        return self.summary(hidden_states).squeeze(-1)


# `logits` `[B, K, V]` and `value` `[B, K]` for the same K positions (all, or the last `logits_to_keep`), the LM's KV
# cache under this transformers release's name for it (`cache`, or `past_key_values`: a field of the old name is
# renamed, and so lost, by newer releases' `ModelOutput`), and the LM's `loss` when `labels` are given.
CausalLMOutputWithValue = make_dataclass(
    "CausalLMOutputWithValue",
    [
        ("logits", "torch.Tensor | None", field(default=None)),
        ("value", "torch.Tensor | None", field(default=None)),
        (CACHE_KEYWORD, "object | None", field(default=None)),
        ("loss", "torch.Tensor | None", field(default=None)),
    ],
    bases=(ModelOutput,),
    namespace={"__module__": __name__},
)


class AutoModelForCausalLMWithValueHead(nn.Module):
    """`pretrained_model` (a causal LM, possibly a `peft.PeftModel`) plus `v_head`, a `ValueHead`.

    Create it with `from_pretrained(name_or_path_or_model, **kwargs)`; `save_pretrained(folder)` writes the LM
    in the Hugging Face format (so `AutoModelForCausalLM.from_pretrained(folder)` loads the policy alone) and
    the head to `value_head.safetensors` beside it, which `from_pretrained(folder)` reads back.
    """

    def __init__(self, pretrained_model: nn.Module) -> None:
        super().__init__()
        self.pretrained_model = pretrained_model
        hidden_size = pretrained_model.get_output_embeddings().in_features
        self.v_head = ValueHead(hidden_size).to(next(pretrained_model.parameters()).device)

    # ----------------------------------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, peft_config=None, **kwargs):
        """Load (or wrap) a causal LM and, where the folder or hub repo has one, its saved value head.

        `pretrained_model_name_or_path`: a hub name, a local folder, or an already built causal LM.
        `peft_config`: when given, a new PEFT adapter is added to the LM. Other kwargs go to
        `AutoModelForCausalLM.from_pretrained`.
        """
        if isinstance(pretrained_model_name_or_path, nn.Module):
            lm, source = pretrained_model_name_or_path, None
        else:
            lm = AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
            source = str(pretrained_model_name_or_path)
        if peft_config is not None:
            from peft import get_peft_model

            lm = get_peft_model(lm, peft_config)
        model = cls(lm)
        if source is not None:
            model.load_value_head(source, kwargs.get("revision"))
        return model

    def load_value_head(self, source: str, revision: str | None = None) -> bool:
        """Load `value_head.safetensors` of a local folder or hub repo into `v_head`; False when it has none."""
        state = _load_value_head_state(source, revision)
        if state is not None:
            self.v_head.load_state_dict(sub_state_dict(state, "v_head."))
        return state is not None

    def save_pretrained(self, save_directory: str, state_dict: dict | None = None, **kwargs) -> None:
        """Write the LM (or its PEFT adapter) with `save_pretrained` and the head to `value_head.safetensors`.

        `state_dict`, when given (e.g. consolidated by DeepSpeed), holds `pretrained_model.*` and `v_head.*`."""
        from safetensors.torch import save_file

        check_save_directory(save_directory)
        lm_state = None if state_dict is None else sub_state_dict(state_dict, "pretrained_model.")
        head_state = self.v_head.state_dict() if state_dict is None else sub_state_dict(state_dict, "v_head.")
        self.pretrained_model.save_pretrained(save_directory, state_dict=lm_state, **kwargs)
        head_state = {f"v_head.{k}": v.detach().cpu().contiguous() for k, v in head_state.items()}
        save_file(head_state, os.path.join(save_directory, VALUE_HEAD_FILE))

    # ---------------------------------------------------------------------------------------- delegation
    @property
    def config(self):
        return self.pretrained_model.config

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def get_input_embeddings(self) -> nn.Module:
        return self.pretrained_model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.pretrained_model.get_output_embeddings()

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        enable_activation_checkpointing(self.pretrained_model, gradient_checkpointing_kwargs)

    def generate(self, *args, **kwargs):
        return self.pretrained_model.generate(*args, **kwargs)

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, input_ids=None, attention_mask=None, **kwargs) -> CausalLMOutputWithValue:
        """The LM's forward (same kwargs: `position_ids`, `logits_to_keep`, `use_cache`, ...) plus the value of
        every position the logits are computed for. -> `CausalLMOutputWithValue`."""
        captured = []
        hook = self.get_output_embeddings().register_forward_hook(
            lambda module, inputs, output: captured.append(inputs[0])
        )
        try:
            output = self.pretrained_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        finally:
            hook.remove()
        value = self.v_head(captured[-1])
        return CausalLMOutputWithValue(output.logits, value, returned_cache(output), getattr(output, "loss", None))


# Where trl <= 0.11 saved the head: its `v_head.*` keys inside the model's own weights file(s).
_TRL011_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_TRL011_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def _load_value_head_state(source: str, revision: str | None) -> dict | None:
    """The saved head of a local folder or hub repo (`value_head.safetensors`, or the `v_head.*` weights that
    trl <= 0.11 wrote into the model's own files), or None when it has none (a plain causal LM)."""
    if os.path.isdir(source):
        return _find_value_head(
            lambda name: os.path.join(source, name) if os.path.isfile(os.path.join(source, name)) else None
        )
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    def fetch(name: str) -> str | None:
        try:
            return hf_hub_download(source, name, revision=revision)
        except EntryNotFoundError:
            return None

    try:
        return _find_value_head(fetch)
    except Exception as error:  # offline, or no access: say so, rather than silently training a fresh head
        logger.warning(f"Could not fetch the value head of {source} ({error}); the value head starts fresh.")
        return None


def _find_value_head(fetch) -> dict | None:
    """The `v_head.*` weights through `fetch(file name) -> local path or None`: our own file first, then trl
    0.11's layout (the weights file named by an index, or the single weights file)."""
    import json

    from safetensors.torch import load_file

    path = fetch(VALUE_HEAD_FILE)
    if path is not None:
        return load_file(path)
    for index_name in _TRL011_INDEX_FILES:
        index_path = fetch(index_name)
        if index_path is not None:
            with open(index_path) as file:
                shards = {shard for key, shard in json.load(file)["weight_map"].items() if key.startswith("v_head.")}
            return _head_weights([fetch(shard) for shard in sorted(shards)]) if shards else None
    for name in _TRL011_WEIGHT_FILES:
        path = fetch(name)
        if path is not None:
            return _head_weights([path])
    return None


def _head_weights(paths: list[str]) -> dict | None:
    """The `v_head.*` tensors of safetensors or torch weight files (only those are read from a safetensors)."""
    from safetensors import safe_open

    state = {}
    for path in paths:
        if path.endswith(".safetensors"):
            with safe_open(path, framework="pt") as file:
                state.update({key: file.get_tensor(key) for key in file.keys() if key.startswith("v_head.")})
        else:
            weights = torch.load(path, map_location="cpu", weights_only=True)
            state.update({key: value for key, value in weights.items() if key.startswith("v_head.")})
    return state or None


def check_save_directory(save_directory) -> None:
    """`save_pretrained` writes a folder: refuse a path that is an existing file (`transformers` would only log
    an error and save nothing)."""
    if os.path.isfile(save_directory):
        raise NotADirectoryError(
            f"Cannot save into {os.fspath(save_directory)!r}: it is an existing file, and a model is saved as a "
            "folder. Pass the path of a folder (it is created if it does not exist)."
        )


def sub_state_dict(state_dict: dict, prefix: str) -> dict:
    """The entries of `state_dict` under `prefix`, with the prefix removed from their names."""
    return {key[len(prefix) :]: value for key, value in state_dict.items() if key.startswith(prefix)}


def is_value_head_model(model) -> bool:
    return isinstance(model, AutoModelForCausalLMWithValueHead)


def causal_lm(model):
    """The causal LM inside an `AutoModelForCausalLMWithValueHead`, or `model` itself."""
    return model.pretrained_model if is_value_head_model(model) else model

"""The four models of PPO: how each is called, wrapped, frozen and (with PEFT) shared.

* policy: a causal LM; `logprobs.response_logprobs` gives the log-probabilities of the response tokens.
* value and reward models: sequence-classification models with a scalar `score` head read on every token
  (`scalar_head_outputs`), as in TRL's PPO.
* reference: a frozen copy of the initial policy, or the policy with its PEFT adapter disabled.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.utils import logging

from . import distributed as dist
from .compat import enable_activation_checkpointing
from .logprobs import ResponseOutput, position_ids_from_mask, response_logprobs
from .modules import decoder_blocks, freeze
from .value_head import AutoModelForCausalLMWithValueHead, causal_lm, is_value_head_model

logger = logging.get_logger(__name__)

try:  # peft is a dependency, but keep `import trl_ppo` working without it
    from peft import PeftModel, get_peft_model
except ImportError:  # pragma: no cover
    PeftModel, get_peft_model = None, None

_DROPOUT_ATTRIBUTES = ("attention_dropout", "hidden_dropout", "attn_dropout", "dropout", "dropout_rate")
_DROPOUT_CONFIG_KEYS = (
    "attention_dropout",
    "hidden_dropout",
    "attention_probs_dropout_prob",
    "hidden_dropout_prob",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "summary_first_dropout",
    "classifier_dropout",
    "dropout",
)


def disable_dropout(model: nn.Module) -> None:
    """Turn off every kind of dropout in `model`.

    PPO needs the training forward to compute the same distribution the rollout sampled from; dropout would
    make the first PPO ratio differ from 1. Besides `nn.Dropout` modules, attention kernels read float
    attributes such as `attention_dropout` when the model is in training mode, so those are zeroed too.
    """
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name in _DROPOUT_ATTRIBUTES:
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)
        config = getattr(module, "config", None)
        for key in _DROPOUT_CONFIG_KEYS:
            if isinstance(getattr(config, key, None), float):
                setattr(config, key, 0.0)


def scalar_head_outputs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Run a sequence-classification model's backbone and its `score` head on every token. -> `[B, L]`.

    Reading the head at a chosen position (the value of each response token, the reward at the last token)
    avoids the model's own pooling, which finds "the last token" by comparing with the pad id and goes wrong
    when the pad token is also the stop token.
    """
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    ).last_hidden_state
    return model.score(hidden).squeeze(-1).float()


def check_scalar_head_model(model: nn.Module, role: str) -> None:
    """Fail early, with the fix, when a value/reward model cannot be read by `scalar_head_outputs`."""
    prefix = getattr(model, "base_model_prefix", None)
    if not prefix or not hasattr(model, prefix) or not hasattr(model, "score"):
        raise TypeError(
            f"The {role} ({type(model).__name__}) must be a sequence-classification model with a backbone at "
            f"`model.base_model_prefix` and a `score` head, e.g. "
            f"`AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)`."
        )
    outputs = getattr(model.score, "out_features", 1)
    if outputs != 1:
        raise ValueError(
            f"The {role} ({type(model).__name__}) has a `score` head with {outputs} outputs; PPO reads one scalar "
            f"per sequence. Load it with one label: `AutoModelForSequenceClassification.from_pretrained(path, "
            f"num_labels=1)`."
        )


def check_causal_lm(model: nn.Module) -> None:
    """Fail early when the policy (inside a value-head model or PEFT adapter) is not a causal language model."""
    lm = causal_lm(model)
    config = getattr(lm, "config", None)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if head is None or getattr(config, "is_encoder_decoder", False):
        raise TypeError(
            f"`model` must be a causal language model (e.g. `AutoModelForCausalLM.from_pretrained(path)`), got "
            f"{type(lm).__name__}: PPO samples responses token by token from its next-token logits."
        )


class PolicyAndValueWrapper(nn.Module):
    """Holds the trained policy and value function as one module, so that one optimizer, one
    `accelerator.prepare` and one checkpoint cover both.

    Either `value_model` is a separate sequence-classification model, or it is None and `policy` is an
    `AutoModelForCausalLMWithValueHead` whose head gives the values in the same forward pass as the logits, or,
    without a `critic` (a critic-free `advantage_estimator`), there is no value function and the values are None.
    """

    def __init__(self, policy: nn.Module, value_model: nn.Module | None, critic: bool = True) -> None:
        super().__init__()
        if critic and value_model is None and not is_value_head_model(policy):
            raise TypeError("Without a `value_model` the policy must be an `AutoModelForCausalLMWithValueHead`.")
        self.policy = policy
        self.value_model = value_model
        self.config = policy.config  # read by `transformers.Trainer`

    @property
    def _no_split_modules(self) -> list[str]:
        """The block classes of the policy and the value model: accelerate's FSDP2 makes each such block a unit."""
        names = []
        for model in (causal_lm(self.policy), self.value_model):
            names += [name for name in getattr(model, "_no_split_modules", None) or [] if name not in names]
        return names

    @property
    def lm(self) -> nn.Module:
        """The causal LM that samples (the policy without its value head)."""
        return causal_lm(self.policy)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        for model in (self.policy, self.value_model):
            if model is not None:
                enable_activation_checkpointing(model, gradient_checkpointing_kwargs)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        responses: torch.Tensor,
        temperature: float,
        chunk_size: int = 0,
        entropy: bool = False,
        keep_logits: bool = False,
        entropy_grad: bool = False,
        values: bool = True,
    ) -> ResponseOutput:
        """Log-probs of the response tokens `responses` `[B, T]` (the end of `input_ids` `[B, L]`) under the
        policy and their values `[B, T]` (float32; None without a critic, and the separate value model's skipped
        with `values=False`); the other arguments as in `logprobs.response_logprobs`."""
        output = response_logprobs(
            self.policy,
            input_ids,
            attention_mask,
            responses,
            temperature,
            chunk_size,
            entropy,
            keep_logits,
            entropy_grad,
        )
        if self.value_model is not None and values:
            output.values = self.values(input_ids, attention_mask, responses.size(1))
        return output

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int) -> torch.Tensor:
        """The separate value model's V(s_t) `[B, T]` before each of the last `response_length` tokens of
        `input_ids` `[B, L]` (the state after the token before it)."""
        return scalar_head_outputs(self.value_model, input_ids, attention_mask)[:, -response_length - 1 : -1]


def with_value_function(
    model: nn.Module, value_model: nn.Module | None, seed: int, head_init: str = "zeros"
) -> nn.Module:
    """The policy to train: `model` as given when a separate `value_model` is checked and used, else `model` with
    a new value head (`AutoModelForCausalLMWithValueHead`): zeros, or with `head_init="normal"` drawn from `seed`."""
    check_causal_lm(model)
    if head_init != "zeros" and (value_model is not None or is_value_head_model(model)):
        which = "a separate `value_model` is given" if value_model is not None else "`model` has its value head"
        logger.warning(
            f"`value_head_init={head_init!r}` has no effect: {which}, so no value head is added. Leave the option "
            "out, or pass a plain causal LM and `value_model=None` for a new head."
        )
    if value_model is not None:
        if is_value_head_model(model):
            raise ValueError(
                "`model` has a value head and a separate `value_model` was given too: pass `value_model=None` to "
                "use the head, or a plain causal LM with the value model."
            )
        check_scalar_head_model(value_model, "value model")
        return model
    if is_value_head_model(model):
        return model
    with torch.random.fork_rng(devices=[]):  # reproducible, and the global RNG stream is left as it was
        torch.manual_seed(seed)
        policy = AutoModelForCausalLMWithValueHead(model)  # its head drawn ("normal"), as from this seed before
    if head_init == "zeros":
        policy.v_head.reset_parameters("zeros")
    return policy


def add_peft_adapter(policy: nn.Module, peft_config) -> nn.Module:
    """Wrap the policy with a new PEFT adapter (the reference is then the same model, adapter disabled)."""
    if get_peft_model is None:
        raise ImportError("`peft_config` needs the `peft` package: `pip install peft`.")
    if PeftModel is not None and isinstance(policy, PeftModel):
        raise ValueError(
            "The policy is already a `PeftModel` and a `peft_config` was given too: pass either a model with its "
            "adapter or a base model with `peft_config`, not both."
        )
    return get_peft_model(policy, peft_config)


def is_peft_model(model: nn.Module) -> bool:
    """Whether `model` (or the causal LM inside a value-head model) is a `peft.PeftModel`."""
    return PeftModel is not None and isinstance(causal_lm(model), PeftModel)


def create_reference_model(model: nn.Module, num_shared_layers: int | None = None) -> nn.Module:
    """A frozen copy of `model` as it is now, to serve as the reference policy.

    With `num_shared_layers`, the input embeddings and the first `num_shared_layers` transformer blocks are not
    copied but shared with `model`, and frozen there too (a reference that moved with the policy would make the
    KL penalty meaningless): less memory, and fewer trained parameters, as in TRL's first PPOTrainer.
    """
    if num_shared_layers is None:
        return freeze(copy.deepcopy(model))
    blocks = decoder_blocks(model)
    if not 0 <= num_shared_layers <= len(blocks):
        raise ValueError(
            f"`num_shared_layers` must be between 0 and {len(blocks)} (the model's blocks), got {num_shared_layers}."
        )
    shared = list(model.get_input_embeddings().parameters())
    for block in blocks[:num_shared_layers]:
        shared.extend(block.parameters())
    for parameter in shared:
        parameter.requires_grad_(False)
    memo = {id(parameter): parameter for parameter in shared}  # deepcopy keeps these objects as they are
    return freeze(copy.deepcopy(model, memo))


@contextlib.contextmanager
def peft_reference(policy: nn.Module, ref_adapter_name: str | None, model_adapter_name: str | None):
    """Context in which a PEFT policy acts as the reference: its adapter disabled, or `ref_adapter_name` active."""
    if ref_adapter_name is None:
        with policy.disable_adapter():
            yield
        return
    policy.set_adapter(ref_adapter_name)
    try:
        yield
    finally:
        policy.set_adapter(model_adapter_name or "default")


def gradient_checkpointing_kwargs(args) -> dict | None:
    """The kwargs for `gradient_checkpointing_enable` when `args` asks for it, else None."""
    if not (args.gradient_checkpointing or getattr(args, "activation_checkpointing", False)):
        return None
    return args.gradient_checkpointing_kwargs or {"use_reentrant": False}


def prepare_models(policy, ref_model, value_model, reward_models, peft_config=None, checkpointing_kwargs=None):
    """Make the models ready for PPO -> (policy, ref_model).

    `policy` is a causal LM or an `AutoModelForCausalLMWithValueHead` (then `value_model` is None). Adds the PEFT
    adapter to the causal LM when `peft_config` is given; without a `ref_model`, the reference is a frozen copy
    of the causal LM, or None for a PEFT policy (its adapter is disabled instead); dropout is turned off in every
    model; gradient checkpointing is enabled on the trained models when `checkpointing_kwargs` is not None.
    """
    lm = causal_lm(policy)
    if ref_model is not None and not is_peft_model(lm) and peft_config is None:
        # Frozen shared layers are fine (`create_reference_model(num_shared_layers=...)`); trained ones are not.
        if any(p.requires_grad for p in shared_parameters(ref_model, lm)):
            raise ValueError(
                "`ref_model` shares trained weights with `model`: pass a separate copy, `None`, or "
                "`create_reference_model(model, num_shared_layers=...)`, which freezes the shared layers."
            )
    if peft_config is not None:
        lm = add_peft_adapter(lm, peft_config)
        if is_value_head_model(policy):
            policy.pretrained_model = lm
        else:
            policy = lm
    if ref_model is None and not is_peft_model(lm):
        if any(hasattr(p, "ds_id") for p in lm.parameters()):
            raise ValueError(
                "The policy was partitioned by DeepSpeed ZeRO-3 as it loaded (`zero3_init_flag: true`), so no "
                "reference can be copied from it: load the reference like the policy and pass it as `ref_model`, "
                "or set `zero3_init_flag: false` in the accelerate config."
            )
        ref_model = create_reference_model(lm)
    for module in (policy, value_model, ref_model, *reward_models):
        if isinstance(module, nn.Module):
            disable_dropout(module)
    if checkpointing_kwargs is not None:
        for module in (policy, value_model):
            if module is not None:
                enable_activation_checkpointing(module, checkpointing_kwargs)
        if is_peft_model(lm):
            lm.enable_input_require_grads()  # LoRA on a frozen base: checkpointed blocks need an input grad
    return policy, ref_model


def shared_parameters(first: nn.Module, second: nn.Module) -> list[nn.Parameter]:
    """The parameters of `second` that are also parameters of `first` (the same tensors, not equal copies)."""
    ids = {id(p) for p in first.parameters()}
    return [p for p in second.parameters() if id(p) in ids]


def context_length(model: nn.Module) -> int | None:
    """The number of positions the model was built for, when its config says."""
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def vocabulary_size(model: nn.Module, tokenizer) -> int:
    """The token ids the policy `model` can read: its input embeddings (often padded beyond the tokenizer, e.g.
    pythia's 50304 for 50277 tokens), or the tokenizer's length where the model does not say."""
    lm = causal_lm(model)
    embeddings = lm.get_input_embeddings() if hasattr(lm, "get_input_embeddings") else None
    return getattr(embeddings, "num_embeddings", None) or len(tokenizer)


def check_vocabularies(tokenizer, models: dict[str, nn.Module | None]) -> None:
    """Every model that reads the policy's token ids must have an embedding for each of them."""
    for role, model in models.items():
        if not isinstance(model, nn.Module) or not hasattr(model, "get_input_embeddings"):
            continue
        size = model.get_input_embeddings().num_embeddings
        if size < len(tokenizer):
            raise ValueError(
                f"`{role}` has {size} token embeddings but the tokenizer has {len(tokenizer)} tokens, so some token "
                f"ids would be out of range. If you added tokens (e.g. a pad token), call "
                f"`{role}.resize_token_embeddings(len(tokenizer))`; a reward model from another model family needs "
                "its own tokenizer: pass it as `reward_processing_class`, and the decoded text is re-encoded for it."
            )


@dataclass(frozen=True)
class PreparedModels:
    """The models of a run as the accelerator placed them: what sampling, the no-grad passes and the update call."""

    accelerator: Any  # accelerate.Accelerator
    model: nn.Module  # the trained PolicyAndValueWrapper as prepared (a DDP module or DeepSpeed engine, or itself)
    ref_model: nn.Module | None  # None: the PEFT policy with its adapter disabled (or `ref_adapter_name`)

    @property
    def wrapper(self) -> PolicyAndValueWrapper:
        """The `PolicyAndValueWrapper` itself, without DDP or DeepSpeed around it."""
        return self.accelerator.unwrap_model(self.model)

    @property
    def is_deepspeed(self) -> bool:
        return dist.deepspeed_zero_stage(self.accelerator) is not None

    @property
    def is_fsdp2(self) -> bool:
        return dist.fsdp.is_fsdp2(self.accelerator)

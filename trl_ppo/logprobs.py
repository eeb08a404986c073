"""Log-probabilities `logprobs` / `ref_logprobs` of the response tokens under a causal LM, and their entropies.

The LM head turns each final hidden state into `V` logits (50k-250k of them). For the episodes of one forward
pass the `[B, T, V]` logits, upcast to float32 and kept for the backward pass, are the largest tensors of a PPO
update. `response_logprobs` avoids them where it can: it runs the model's backbone, then the LM head on
`chunk_size` response tokens at a time, so only one chunk of logits exists at once; under autograd each chunk is
recomputed in the backward pass (`torch.utils.checkpoint`) instead of stored. The numbers are those of the
plain forward, `log_softmax(lm(...).logits / temperature)` at the sampled tokens.

That path is taken only for transformers' own causal-LM classes of the architectures listed in
`HIDDEN_STATE_ARCHITECTURES`, whose forward is exactly `lm_head(final hidden states)`. Models that scale or
soft-cap their logits after the head (Gemma 2/3, Cohere, Granite, ...), custom classes and PEFT prompt-learning
adapters are called whole, and their full logits computed at once, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import ppo
from .value_head import causal_lm, is_value_head_model

try:  # peft is a dependency, but keep `import trl_ppo` working without it
    from peft import PeftModel
except ImportError:  # pragma: no cover
    PeftModel = None

# model_type of the architectures whose `...ForCausalLM.forward` computes `lm_head(hidden_states[:, slice])` and
# nothing else after the backbone (checked against their transformers source; extend only the same way).
HIDDEN_STATE_ARCHITECTURES = frozenset(
    {"gpt_neox", "gpt2", "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "olmo2", "phi3"}
)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over the attended tokens only, so a left-padded prompt starts at 0. `[B, L]`."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def response_forward(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int):
    """The model's forward over prompt + response `[B, L]`, with the LM head (and a value head, if any) applied
    only to the `response_length + 1` last positions (`logits_to_keep`), so no logits of the prompt exist."""
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        logits_to_keep=response_length + 1,
        use_cache=False,
    )


@dataclass
class ResponseOutput:
    """What one forward pass gives about `B` episodes' `T` response tokens."""

    logprobs: torch.Tensor  # [B, T] float32, log-prob of each sampled token under softmax(logits / temperature)
    entropy: torch.Tensor | None = None  # [B, T] float32, when asked for (with gradient only if asked for)
    values: torch.Tensor | None = None  # [B, T] float32, V(s_t); from a value head or value model
    logits: torch.Tensor | None = None  # [B, T, V] / temperature; only when asked for (kl_penalty="full")


def response_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    responses: torch.Tensor,
    temperature: float,
    chunk_size: int = 0,
    entropy: bool = False,
    keep_logits: bool = False,
    entropy_grad: bool = False,
) -> ResponseOutput:
    """Log-probs `[B, T]` of `responses` `[B, T]`, the last `T` tokens of `input_ids` `[B, L]`, under `model`
    (a causal LM, or an `AutoModelForCausalLMWithValueHead`, which also gives `values`).

    `chunk_size` > 0 computes them from the final hidden states, `chunk_size` tokens at a time, where the model
    allows (module docstring); `keep_logits` (the exact KL needs whole distributions) and `chunk_size=0` run the
    plain forward. `entropy` adds the entropy of each position's distribution, without gradient unless
    `entropy_grad` (the entropy bonus of the loss)."""
    length = responses.size(1)
    parts = hidden_state_parts(causal_lm(model)) if chunk_size > 0 and not keep_logits else None
    if parts is None:
        output = response_forward(model, input_ids, attention_mask, length)
        logits = output.logits[:, :-1].float() / temperature  # float32, as the sampler divides them
        values = output.value[:, :-1].float() if is_value_head_model(model) else None
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropies = ppo.entropy_from_logits(logits) if entropy else None
        logprobs = ppo.logprobs_from_logits(logits, responses)
        return ResponseOutput(logprobs, entropies, values, logits if keep_logits else None)
    backbone, head = parts
    hidden = backbone(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    ).last_hidden_state[:, -length - 1 : -1]
    chunking = (temperature, chunk_size, entropy, entropy_grad)
    logprobs, entropies = chunked_token_logprobs(head, hidden, responses, *chunking)
    values = model.v_head(hidden).float() if is_value_head_model(model) else None
    return ResponseOutput(logprobs, entropies, values)


def chunked_token_logprobs(
    head: nn.Module,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    chunk_size: int,
    entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`head` (the LM head) applied to `chunk_size` of the hidden states `[B, T, H]` at a time -> (log-probs of
    `tokens` `[B, T]`, entropies `[B, T]` or None), float32. With gradients enabled, each chunk's logits are
    recomputed in the backward pass instead of kept."""
    shape = tokens.shape
    hidden_chunks = hidden.reshape(-1, hidden.size(-1)).split(chunk_size)
    token_chunks = tokens.reshape(-1).split(chunk_size)
    logprobs, entropies = [], []
    for hidden_chunk, token_chunk in zip(hidden_chunks, token_chunks):
        inputs = (head, hidden_chunk, token_chunk, temperature, entropy, entropy_grad)
        if torch.is_grad_enabled():
            chunk = checkpoint(_chunk_logprobs, *inputs, use_reentrant=False)
        else:
            chunk = _chunk_logprobs(*inputs)
        logprobs.append(chunk[0])
        entropies.append(chunk[1])
    logprobs = torch.cat(logprobs).reshape(shape)
    return logprobs, torch.cat(entropies).reshape(shape) if entropy else None


def _chunk_logprobs(
    head: nn.Module, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float, entropy: bool, entropy_grad: bool
):
    logits = head(hidden).float() / temperature  # [N, V] float32, as the sampler divides them
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropies = ppo.entropy_from_logits(logits) if entropy else None
    return ppo.logprobs_from_logits(logits, tokens), entropies


def hidden_state_parts(lm: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(backbone, LM head) of a causal LM whose logits are exactly `head(backbone(...).last_hidden_state)`, or
    None where that is not known to hold (then the model is called whole)."""
    model = lm
    if PeftModel is not None and isinstance(lm, PeftModel):
        if lm.active_peft_config.is_prompt_learning:  # virtual tokens are added in PeftModel's own forward
            return None
        model = lm.get_base_model()  # LoRA-style adapters live inside its modules
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in HIDDEN_STATE_ARCHITECTURES or not type(model).__module__.startswith("transformers."):
        return None
    backbone, head = getattr(model, "base_model", None), model.get_output_embeddings()
    if backbone is None or backbone is model or head is None:
        return None
    return backbone, head

"""`trl.core`'s helpers that scripts for trl <= 0.11 import: `respond_to_batch`, `LengthSampler`, `set_seed`."""

from __future__ import annotations

import random

import torch
from transformers import set_seed
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from ..compat import cache_keyword, returned_cache
from ..value_head import causal_lm


@torch.no_grad()
def respond_to_batch(
    model: torch.nn.Module, queries: torch.Tensor, txt_len: int = 20, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Sample exactly `txt_len` tokens after each query `[B, Lq]` (no stop token, no padding: the queries share
    one length) from softmax(logits), keeping the `top_k` most likely tokens (0: all) and the smallest set of
    probability `top_p`. -> the responses `[B, txt_len]`."""
    lm = causal_lm(model)
    warpers = [TopKLogitsWarper(top_k)] if top_k > 0 else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1.0 else []
    input_ids = queries.to(lm.device)
    output = lm(input_ids=input_ids, use_cache=True)
    generated = []
    for _ in range(txt_len):
        logits = output.logits[:, -1, :].float()
        for warp in warpers:
            logits = warp(input_ids, logits)
        token = torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1)
        generated.append(token)
        input_ids = torch.cat([input_ids, token], dim=-1)
        output = lm(input_ids=token, use_cache=True, **{cache_keyword(lm): returned_cache(output)})
    return torch.cat(generated, dim=-1)


class LengthSampler:
    """Draws a length uniformly from `range(min_value, max_value)` at each call (a response length for
    `PPOTrainer.generate(length_sampler=...)`)."""

    def __init__(self, min_value: int, max_value: int) -> None:
        if max_value <= min_value:
            raise ValueError(f"`LengthSampler` needs min_value < max_value, got {min_value} and {max_value}.")
        self.values = list(range(min_value, max_value))

    def __call__(self) -> int:
        return random.choice(self.values)


__all__ = ["LengthSampler", "respond_to_batch", "set_seed"]

"""How far the training forward's log-probs are from the sampler's (the training/inference mismatch): the same
tokens, scored once by the sampler that drew them (KV caches, batched decoding, its own kernels) and once by the
update's forward over the whole episode. With a correct cache the two agree to float rounding; a cache that lost
or shifted a token shows up here first."""

from __future__ import annotations

import torch

RATIO_BAND = (0.9, 1.1)  # a token whose ratio pi_train / pi_sampler leaves this band counts as a mismatch


def agreement_sums(sampler_logprobs: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[4]`: the sum and the max of |log pi_train - log pi_sampler| over the tokens of `mask`, the number of those
    tokens whose ratio exp(log pi_train - log pi_sampler) is outside `RATIO_BAND`, and the number of tokens. Inputs
    `[B, T]`; sums rather than means so that processes add them up."""
    difference = (logprobs - sampler_logprobs).float()[mask]
    if difference.numel() == 0:
        return torch.zeros(4, dtype=torch.float64, device=logprobs.device)
    ratio = difference.exp()
    outside = (ratio < RATIO_BAND[0]) | (ratio > RATIO_BAND[1])
    sums = [difference.abs().sum(), difference.abs().max(), outside.sum(), torch.tensor(difference.numel())]
    return torch.stack([value.to(torch.float64).to(logprobs.device) for value in sums])


def agreement_metrics(sums: torch.Tensor) -> dict[str, float]:
    """`agreement_sums` of every process `[P, 4]` -> `rollout/logprob_diff_mean`, `rollout/logprob_diff_max`,
    `rollout/logprob_diff_ratio_outside` (the share of tokens whose ratio is outside `RATIO_BAND`)."""
    total, largest, outside, count = sums.sum(0)[0], sums[:, 1].max(), sums.sum(0)[2], sums.sum(0)[3]
    count = max(float(count), 1.0)
    return {
        "rollout/logprob_diff_mean": float(total) / count,
        "rollout/logprob_diff_max": float(largest),
        "rollout/logprob_diff_ratio_outside": float(outside) / count,
    }

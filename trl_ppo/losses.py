"""The PPO losses, as pure tensor functions: each takes per-token tensors `[B, T]` and a response mask and
returns `(loss, stats)`, the loss reduced by a `LossAggregation` and the stats detached 0-d tensors.

`loss_agg_mode` (how per-token losses become one number) is `LossAggregation`; the update (`update.py`) gives
it the count of the whole minibatch, so that micro-batch losses add up to the minibatch's loss whatever the
micro-batch split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kl import kl_estimate
from .ppo import masked_mean

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregation_count(response_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """What `mode` averages over, counted in a batch `[B, T]` -> 0-d float: its response tokens for "token-mean",
    else its sequences that have at least one response token."""
    if mode == "token-mean":
        return response_mask.sum().float()
    return response_mask.any(-1).sum().float()


def aggregate_loss(
    values: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str = "token-mean",
    normaliser: torch.Tensor | float | None = None,
    response_length: int | None = None,
) -> torch.Tensor:
    """Per-token losses `values` `[B, T]` -> one number, over the tokens where `response_mask` is True.

      "token-mean"               sum over all tokens / number of tokens
      "seq-mean-token-mean"      each sequence's token mean, then the mean over sequences
      "seq-mean-token-sum"       each sequence's token sum, then the mean over sequences
      "seq-mean-token-sum-norm"  each sequence's token sum / `response_length` (a constant, so no length bias:
                                 Dr. GRPO), then the mean over sequences
    `normaliser` replaces this batch's own count (`aggregation_count`) in the final division: with the count of a
    whole minibatch, the results of its micro-batches add up to the minibatch's loss.
    """
    if mode == "token-mean":
        total = (values * response_mask).sum()
    else:
        if mode == "seq-mean-token-mean":
            per_sequence = masked_mean(values, response_mask, dim=-1)
        elif mode == "seq-mean-token-sum":
            per_sequence = (values * response_mask).sum(-1)
        elif mode == "seq-mean-token-sum-norm":
            if response_length is None:
                raise ValueError("loss_agg_mode 'seq-mean-token-sum-norm' divides by `response_length`: pass it.")
            per_sequence = (values * response_mask).sum(-1) / response_length
        else:
            raise ValueError(f"Unknown loss_agg_mode {mode!r}: use one of {LOSS_AGG_MODES}.")
        total = per_sequence.sum()  # a sequence without response tokens adds 0 and is not counted
    count = aggregation_count(response_mask, mode) if normaliser is None else normaliser
    return total / (count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1))


@dataclass(frozen=True)
class LossAggregation:
    """`aggregate_loss` with its settings fixed: `mode` (`loss_agg_mode`), the `normaliser` of the batch being
    reduced (None: its own count) and `response_length` (for "seq-mean-token-sum-norm")."""

    mode: str = "token-mean"
    normaliser: torch.Tensor | float | None = None
    response_length: int | None = None

    def __call__(self, values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
        return aggregate_loss(values, response_mask, self.mode, self.normaliser, self.response_length)


TOKEN_MEAN = LossAggregation()


def policy_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float,
    cliprange_high: float | None = None,
    dual_clip: float | None = None,
    aggregate: LossAggregation = TOKEN_MEAN,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate loss (Schulman et al. 2017): per token max(-A * r, -A * clip(r, 1 - cliprange,
    1 + cliprange_high)), r = pi / pi_old, reduced by `aggregate`.

    `cliprange_high` (default `cliprange`) makes the clipping asymmetric ("clip-higher", DAPO). `dual_clip`
    (`c` > 1, Ye et al. 2020) also bounds the loss of a token with negative advantage by -A * c. `weights` `[B, T]`
    (detached) multiply each token's clipped loss: an off-policy correction's (`off_policy.behaviour_weights`), with
    `old_logprobs` then the proximal policy's. All inputs `[B, T]`. Returns the loss and detached stats:
    `clipfrac` (fraction of tokens where the clipped term is the active one), `approxkl` (0.5 * mean squared
    log-ratio), `ratio` (mean probability ratio); with `cliprange_high`, `clipfrac_low` / `clipfrac_high` (ratio
    clipped below / above); with `dual_clip`, `dual_clipfrac` (tokens where the dual bound is the active one).
    """
    high = cliprange if cliprange_high is None else cliprange_high
    log_ratio = new_logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + high)
    per_token = torch.max(unclipped, clipped)
    if dual_clip is not None:
        dual_bound = -advantages * dual_clip
        dual_active = (advantages < 0) & (per_token > dual_bound)
        per_token = torch.where(advantages < 0, torch.min(per_token, dual_bound), per_token)
    if weights is not None:
        per_token = weights * per_token
    loss = aggregate(per_token, response_mask)
    with torch.no_grad():
        clip_active = clipped > unclipped
        stats = {
            "clipfrac": masked_mean(clip_active.float(), response_mask),
            "approxkl": 0.5 * masked_mean(log_ratio**2, response_mask),
            "ratio": masked_mean(ratio, response_mask),
        }
        if cliprange_high is not None:
            stats["clipfrac_low"] = masked_mean((clip_active & (ratio < 1.0)).float(), response_mask)
            stats["clipfrac_high"] = masked_mean((clip_active & (ratio > 1.0)).float(), response_mask)
        if dual_clip is not None:
            stats["dual_clipfrac"] = masked_mean(dual_active.float(), response_mask)
    return loss, stats


def value_loss(
    new_values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    aggregate: LossAggregation = TOKEN_MEAN,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: 0.5 * max((V - R)^2, (V_clipped - R)^2) per token, V_clipped within +-cliprange_value
    of the rollout's values, reduced by `aggregate`. All inputs `[B, T]`. Returns the loss and `clipfrac`."""
    clipped_values = old_values + torch.clamp(new_values - old_values, -cliprange_value, cliprange_value)
    unclipped_loss = (new_values - returns) ** 2
    clipped_loss = (clipped_values - returns) ** 2
    loss = 0.5 * aggregate(torch.max(unclipped_loss, clipped_loss), response_mask)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((clipped_loss > unclipped_loss).float(), response_mask)}
    return loss, stats


def entropy_loss(
    entropy: torch.Tensor, response_mask: torch.Tensor, aggregate: LossAggregation = TOKEN_MEAN
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The entropy bonus as a loss: minus the policy's entropy `[B, T]` reduced by `aggregate` (the update adds
    `entropy_coef` times it, so minimising it raises the entropy). Returns the loss and `entropy` (token mean)."""
    loss = -aggregate(entropy, response_mask)
    return loss, {"entropy": masked_mean(entropy.detach(), response_mask)}


def kl_loss(
    new_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    estimator: str = "k3",
    aggregate: LossAggregation = TOKEN_MEAN,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL(policy || reference) as a loss term, its gradient flowing through the policy's log-probs: the per-token
    `kl.kl_estimate` (k3 clamped) of `new_logprobs` against `ref_logprobs`, both `[B, T]`, reduced by `aggregate`.
    Returns the loss and `kl` (the token mean of the estimate)."""
    per_token = kl_estimate(new_logprobs, ref_logprobs, estimator, clamp=True)
    loss = aggregate(per_token, response_mask)
    return loss, {"kl": masked_mean(per_token.detach(), response_mask)}

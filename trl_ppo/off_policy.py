"""Off-policy corrections: the per-token weights that keep PPO's update right when the episodes were sampled by
another policy than the one the update starts from (asynchronous sampling with `max_staleness`, or a sampler whose
numerics differ from the trainer's), as pure tensor functions.

Three policies take part (AReaL's names, Fu et al. 2025, arXiv 2505.24298):
  pi_theta   the policy being optimised (the update's forward);
  pi_prox    the proximal policy: the one this update starts from, its log-probs computed by the trainer at training
             time. PPO's ratio pi_theta / pi_prox is clipped against it, so the trust region is around weights the
             trainer holds, not around old ones;
  pi_behav   the behaviour policy: the one that sampled the episode, its log-probs recorded by the sampler.

A correction turns pi_prox / pi_behav into a weight per token that multiplies that token's clipped PPO loss:
  "decoupled"  AReaL's decoupled PPO objective: the weight pi_prox / pi_behav itself (unbiased, unbounded);
  "tis"        truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly brings you
               off-policy RL training"): min(pi_prox / pi_behav, C), bounded by C at the price of a bias;
  "mis"        masked importance sampling (AReaL's `behav_imp_weight_cap`): pi_prox / pi_behav where it is <= C and
               0 above, so a token the sampler drew far more readily than the proximal policy would is dropped from
               the update instead of being kept at weight C;
  "none"       weight 1: the staleness is ignored (the ablation).
"""

from __future__ import annotations

import torch

from .ppo import masked_mean

CORRECTIONS = ("decoupled", "tis", "mis", "none")
CAPPED = ("tis", "mis")  # the corrections that use `tis_cap`


def behaviour_weights(
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    correction: str,
    tis_cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weight of each token's PPO loss under `correction`, and what it did.

    proximal_logprobs, behaviour_logprobs `[B, T]`: log pi_prox and log pi_behav of each sampled token (no
    gradients: both are numbers recorded before the update's forward). response_mask `[B, T]` bool: the tokens
    trained on; elsewhere the weight is 1. `tis_cap`: C of "tis" and "mis".
    Returns the weights `[B, T]` (detached) and stats over the masked tokens, detached 0-d tensors: `is_weight_mean`
    and `is_weight_max` (the raw pi_prox / pi_behav, before any truncation: how far the sampler was from the
    proximal policy) and `is_truncated_frac` (tokens whose raw weight exceeded C, truncated by "tis" or masked by
    "mis"; else 0).
    """
    if correction not in CORRECTIONS:
        raise ValueError(f"Unknown off-policy correction {correction!r}: use one of {', '.join(CORRECTIONS)}.")
    with torch.no_grad():
        raw = torch.exp(proximal_logprobs.float() - behaviour_logprobs.float())
        raw = torch.where(response_mask, raw, torch.ones_like(raw))
        truncated = (raw > tis_cap) & response_mask if correction in CAPPED else torch.zeros_like(response_mask)
        if correction == "decoupled":
            weights = raw
        elif correction == "tis":
            weights = raw.clamp(max=tis_cap)
        elif correction == "mis":
            weights = raw.masked_fill(truncated, 0.0)
        else:
            weights = torch.ones_like(raw)
        masked_max = raw.masked_fill(~response_mask, float("-inf")).max() if response_mask.any() else raw.new_ones(())
        stats = {
            "is_weight_mean": masked_mean(raw, response_mask),
            "is_weight_max": masked_max,
            "is_truncated_frac": masked_mean(truncated.float(), response_mask),
        }
    return weights.to(proximal_logprobs.dtype), stats

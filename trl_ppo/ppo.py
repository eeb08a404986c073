"""The PPO math for language models, as small pure tensor functions (no models, no I/O).

Shapes: `B` episodes, `T` response tokens. A response mask is a bool tensor `[B, T]` that is True on the
tokens the policy produced, up to and including the stop token, and False on the padding after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Stored in place of a log-probability on padding positions, so that a stray use is visible (a real
# log-probability is never positive).
INVALID_LOGPROB = 1.0


# --------------------------------------------------------------------------------------------------- statistics
def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` over the positions where `mask` is True (over all positions, or along `dim`)."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `values` over the masked positions, with Bessel's correction when `unbiased`."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    count = mask.sum()
    if unbiased and count > 1:  # a single value has variance 0 either way
        var = var * count / (count - 1)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise `values` to unit variance over the masked positions; with `shift_mean` also to zero mean."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


# ------------------------------------------------------------------------------------------------ token level
def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probability of each chosen token. logits `[B, T, V]`, tokens `[B, T]` -> `[B, T]` (float32).

    Gathers the chosen logit and subtracts the log-partition, so no `[B, T, V]` log-softmax is materialised.
    """
    logits = logits.float()
    chosen = torch.gather(logits, -1, tokens.unsqueeze(-1)).squeeze(-1)
    return chosen - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution given by `logits` `[..., V]` -> `[...]` (float32)."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def first_true_indices(bools: torch.Tensor) -> torch.Tensor:
    """Index of the first True in each row of `bools` `[B, T]`; `T` for a row with none. -> `[B]` (long)."""
    length = bools.size(-1)
    positions = torch.arange(length, device=bools.device).expand_as(bools)
    return torch.where(bools, positions, length).min(-1).values


def response_mask_after_stop(responses: torch.Tensor, stop_token_id: int | None) -> torch.Tensor:
    """True on every response token up to and including the first stop token. responses `[B, T]` -> `[B, T]`.

    Without a stop token every sampled token is part of the response.
    """
    if stop_token_id is None:
        return torch.ones_like(responses, dtype=torch.bool)
    lengths = first_true_indices(responses == stop_token_id) + 1  # keep the stop token itself
    positions = torch.arange(responses.size(1), device=responses.device)
    return positions.unsqueeze(0) < lengths.unsqueeze(1)


def last_token_index(response_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last True of each row of a response mask `[B, T]` (the stop token when there is one; a mask
    given to `step()` may have gaps); 0 for an empty row. -> `[B]` (long). The score is credited there."""
    length = response_mask.size(-1)
    last = length - 1 - response_mask.long().flip(-1).argmax(-1)
    return last.masked_fill(~response_mask.any(-1), 0)


def pad_responses(values: torch.Tensor, length: int, fill: float) -> torch.Tensor:
    """Per-token values of responses `[B, T' <= length]` right-padded with `fill` to `[B, length]`."""
    return torch.nn.functional.pad(values, (0, length - values.size(1)), value=fill)


def truncate_after_stop_token(responses: torch.Tensor, stop_token_id: int | None, pad_token_id: int) -> torch.Tensor:
    """Replace everything after the first stop token by `pad_token_id`. `[B, T]` -> `[B, T]`."""
    return responses.masked_fill(~response_mask_after_stop(responses, stop_token_id), pad_token_id)


def contains_stop_token(responses: torch.Tensor, response_mask: torch.Tensor, stop_token_id: int) -> torch.Tensor:
    """Whether each response `[B, T]` contains the stop token within its mask. -> `[B]` bool."""
    return ((responses == stop_token_id) & response_mask).any(-1)


def apply_missing_eos_penalty(
    scores: torch.Tensor, has_stop_token: torch.Tensor, missing_eos_penalty: float | None
) -> torch.Tensor:
    """Subtract `missing_eos_penalty` from the score `[B]` of every response without its stop token."""
    if missing_eos_penalty is None:
        return scores
    return scores - missing_eos_penalty * (~has_stop_token).to(scores.dtype)


# ---------------------------------------------------------------------------------------------------- rewards
def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs. `[B, T]` -> `[B, T]`.

    With `log_ratio = logprobs - ref_logprobs` (log pi / pi_ref, the convention of every function here):
      k1 = log_ratio                             (unbiased, can be negative per token)
      k3 = (pi_ref / pi - 1) + log_ratio         (unbiased, never negative, lower variance)
    See http://joschu.net/blog/kl-approx.html.
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"Unknown kl_estimator {estimator!r}: use 'k1' or 'k3'.")


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, penalty: str = "kl", estimator: str = "k1"
) -> torch.Tensor:
    """Per-token KL penalty from the sampled tokens' log-probs. `[B, T]` -> `[B, T]`.

    With `log_ratio = logprobs - ref_logprobs` (log pi / pi_ref):
      "kl"  -> `kl_estimate` with `estimator` (k1 = log_ratio, or k3)
      "abs" -> |log_ratio|
      "mse" -> 0.5 * log_ratio^2
    ("full" needs the whole distributions: `full_kl_from_logits`.)
    """
    if penalty == "kl":
        return kl_estimate(logprobs, ref_logprobs, estimator)
    log_ratio = logprobs - ref_logprobs
    if penalty == "abs":
        return log_ratio.abs()
    if penalty == "mse":
        return 0.5 * log_ratio.square()
    raise ValueError(f"Unknown kl_penalty {penalty!r} here: use 'kl', 'abs' or 'mse' ('full' needs the logits).")


def full_kl_from_logits(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """Exact KL(pi || pi_ref) between two next-token distributions at every position.
    logits, ref_logits `[B, T, V]` -> `[B, T]` (float32): sum_v pi(v) * (log pi(v) - log pi_ref(v))."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    ref_logp = torch.log_softmax(ref_logits.float(), dim=-1)
    return (logp.exp() * (logp - ref_logp)).sum(-1)


def per_token_kl(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    penalty: str = "kl",
    estimator: str = "k1",
    full_kl: torch.Tensor | None = None,
) -> torch.Tensor:
    """The per-token KL term of the rewards `[B, T]`, zero on padding: `kl_penalty(penalty, estimator)` of the
    log-probs `[B, T]`, or, for `penalty="full"`, the exact `full_kl` `[B, T]` computed from the logits."""
    kl = full_kl if penalty == "full" else kl_penalty(logprobs, ref_logprobs, penalty, estimator)
    return kl.masked_fill(~response_mask, 0.0)


@dataclass
class Rewards:
    """Per-token rewards of one rollout and their parts. `B` episodes, `T` response tokens; zero on padding."""

    rewards: torch.Tensor  # [B, T] -kl_coef * kl on every token, plus the shaped score on the last one
    kl: torch.Tensor  # [B, T] the per-token KL term
    non_score_rewards: torch.Tensor  # [B, T] -kl_coef * kl
    shaped_scores: torch.Tensor  # [B] the scores as the rewards use them (after scaling and clipping)


def kl_shaped_rewards(
    shaped_scores: torch.Tensor, kl: torch.Tensor, response_mask: torch.Tensor, kl_coef: float, whiten: bool = False
) -> Rewards:
    """`per_token_rewards`, whitened (scale only, no mean shift) over the response tokens when `whiten`.
    shaped_scores `[B]`, kl and response_mask `[B, T]` -> `Rewards`."""
    rewards, non_score_rewards = per_token_rewards(shaped_scores, kl, response_mask, kl_coef)
    if whiten:
        rewards = masked_whiten(rewards, response_mask, shift_mean=False).masked_fill(~response_mask, 0.0)
    return Rewards(rewards, kl, non_score_rewards, shaped_scores)


def per_token_rewards(
    scores: torch.Tensor, kl: torch.Tensor, response_mask: torch.Tensor, kl_coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards: `-kl_coef * kl` on every response token, plus the score on the last response token.

    The score is credited to the last token the policy produced (its stop token when it has one). TRL's
    PPOv2 credited it one position later, on the first padding token.

    scores `[B]`, kl `[B, T]`, response_mask `[B, T]` -> (rewards `[B, T]`, non_score_rewards `[B, T]`),
    both zero outside the mask.
    """
    non_score_rewards = (-kl_coef * kl).masked_fill(~response_mask, 0.0)
    rewards = non_score_rewards.clone()
    rows = torch.arange(rewards.size(0), device=rewards.device)
    rewards[rows, last_token_index(response_mask)] += scores.to(rewards.dtype)
    return rewards, non_score_rewards


def adaptive_kl_coef(kl_coef: float, kl: float, kl_target: float, kl_horizon: int, num_episodes: int) -> float:
    """The KL coefficient after one update under adaptive KL control (Ziegler et al. 2019, section 2.2).

    error = clip(kl / kl_target - 1, -0.2, 0.2);   kl_coef <- kl_coef * (1 + error * num_episodes / kl_horizon)
    `kl` is the mean per-sequence KL of the update, `num_episodes` the episodes it used: the coefficient grows
    when the policy drifts past the target and shrinks when it stays closer.
    """
    error = min(max(kl / kl_target - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + error * num_episodes / kl_horizon)


class RunningMoments:
    """Mean and variance of every score seen so far (Chan et al.'s parallel update), for score scaling.
    `update` takes the scores of one update from all processes, so every process holds the same moments."""

    def __init__(self) -> None:
        self.mean, self.var, self.count = 0.0, 1.0, 0

    def update(self, values: torch.Tensor) -> None:
        values = values.detach().double().reshape(-1)
        n = values.numel()
        if n == 0:
            return
        batch_mean, batch_var = values.mean().item(), values.var(unbiased=False).item()
        total = self.count + n
        delta = batch_mean - self.mean
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.mean, self.var, self.count = self.mean + delta * n / total, m2 / total, total

    @property
    def std(self) -> float:
        """Sample standard deviation (Bessel-corrected) of all values seen."""
        return (self.var * self.count / max(self.count - 1, 1)) ** 0.5

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = state["mean"], state["var"], state["count"]


def shape_scores(
    scores: torch.Tensor, mean: float, std: float, scale: bool, norm: bool, clip: float | None
) -> torch.Tensor:
    """Score shaping of TRL's first PPOTrainer. scores `[B]` -> `[B]`: divided by `std` when `scale` (after
    subtracting `mean` when `norm`), then clipped to [-clip, clip] when `clip` is set. A `std` of 0 (every score
    so far equal) leaves the scale alone rather than multiplying the scores by 1/eps."""
    if scale:
        scores = ((scores - mean) if norm else scores) / (std if std > 1e-8 else 1.0)
    if clip is not None:
        scores = scores.clamp(-clip, clip)
    return scores


# ------------------------------------------------------------------------------------------------- advantages
def compute_gae(
    rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) over the response tokens.

    delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lam * A_{t+1},   returns = A + V.
    The episode ends after the last response token (V after it is 0).

    rewards, values, response_mask `[B, T]` -> (advantages `[B, T]`, returns `[B, T]`), zero outside the mask.
    """
    rewards = rewards.masked_fill(~response_mask, 0.0)
    values = values.masked_fill(~response_mask, 0.0)
    advantages_reversed = []
    last_advantage = torch.zeros_like(rewards[:, 0])
    length = rewards.size(1)
    for t in reversed(range(length)):
        next_values = values[:, t + 1] if t + 1 < length else torch.zeros_like(values[:, t])
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last_advantage = delta + gamma * lam * last_advantage
        advantages_reversed.append(last_advantage)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values
    return advantages.masked_fill(~response_mask, 0.0), returns.masked_fill(~response_mask, 0.0)


@dataclass
class Advantages:
    """What the update optimises towards, for one rollout: both `[B, T]`, zero on padding."""

    advantages: torch.Tensor  # GAE advantages, whitened over the response tokens
    returns: torch.Tensor  # advantages (before whitening) + values: the value function's targets


def advantages_and_returns(
    rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam: float
) -> Advantages:
    """`compute_gae`, then the advantages whitened (zero mean, unit variance over the response tokens).
    rewards, values, response_mask `[B, T]` -> `Advantages`."""
    advantages, returns = compute_gae(rewards, values, response_mask, gamma, lam)
    advantages = masked_whiten(advantages, response_mask).masked_fill(~response_mask, 0.0)
    return Advantages(advantages, returns)


# ----------------------------------------------------------------------------------------------------- losses
def policy_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate loss (Schulman et al. 2017), averaged over the response tokens.

    All inputs `[B, T]`. Returns the loss and detached stats: `clipfrac` (fraction of tokens where the clipped
    term is the active one), `approxkl` (0.5 * mean squared log-ratio) and `ratio` (mean probability ratio).
    """
    log_ratio = new_logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.max(unclipped, clipped), response_mask)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((clipped > unclipped).float(), response_mask),
            "approxkl": 0.5 * masked_mean(log_ratio**2, response_mask),
            "ratio": masked_mean(ratio, response_mask),
        }
    return loss, stats


def value_loss(
    new_values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: 0.5 * mean(max((V - R)^2, (V_clipped - R)^2)), V_clipped within +-cliprange_value
    of the rollout's values. All inputs `[B, T]`. Returns the loss and `clipfrac` (detached)."""
    clipped_values = old_values + torch.clamp(new_values - old_values, -cliprange_value, cliprange_value)
    unclipped_loss = (new_values - returns) ** 2
    clipped_loss = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(unclipped_loss, clipped_loss), response_mask)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((clipped_loss > unclipped_loss).float(), response_mask)}
    return loss, stats

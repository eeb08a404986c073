"""KL(policy || reference): the per-token estimators, the penalty in the rewards, and adaptive KL control.

Pure tensor functions. Every function reads `log_ratio = logprobs - ref_logprobs` (log pi / pi_ref) of the
sampled tokens; shapes: `B` episodes, `T` response tokens. Change the KL estimator here: `kl_estimate` (the
per-token value, used in the rewards by `kl_penalty` and as a loss by `losses.kl_loss`).
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
# The clamps of the k3 loss (as veRL's "low_var_kl"): exp() of a log-ratio far from 0 overflows or dominates a
# minibatch, and large-scale runs reported NaN losses from it.
K3_LOG_RATIO_CLAMP = 20.0
K3_LOSS_CLAMP = 10.0


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1", clamp: bool = False
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs. `[B, T]` -> `[B, T]`.

    With `log_ratio = logprobs - ref_logprobs` (log pi / pi_ref):
      k1 = log_ratio                             (unbiased, can be negative per token)
      k2 = 0.5 * log_ratio^2                     (biased, never negative, low variance)
      k3 = (pi_ref / pi - 1) + log_ratio         (unbiased, never negative, lower variance)
    See http://joschu.net/blog/kl-approx.html. `clamp` bounds k3 for use as a loss: the log-ratio to
    [-20, 20] before the exponential and the estimate to at most 10.
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        if not clamp:
            return torch.expm1(-log_ratio) + log_ratio
        log_ratio = log_ratio.clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
        return (torch.expm1(-log_ratio) + log_ratio).clamp(max=K3_LOSS_CLAMP)
    raise ValueError(f"Unknown KL estimator {estimator!r}: use one of {KL_ESTIMATORS}.")


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, penalty: str = "kl", estimator: str = "k1"
) -> torch.Tensor:
    """Per-token KL penalty from the sampled tokens' log-probs. `[B, T]` -> `[B, T]`.

    With `log_ratio = logprobs - ref_logprobs` (log pi / pi_ref):
      "kl"  -> `kl_estimate` with `estimator` (k1, k2 or k3)
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


def adaptive_kl_coef(kl_coef: float, kl: float, kl_target: float, kl_horizon: int, num_episodes: int) -> float:
    """The KL coefficient after one update under adaptive KL control (Ziegler et al. 2019, section 2.2).

    error = clip(kl / kl_target - 1, -0.2, 0.2);   kl_coef <- kl_coef * (1 + error * num_episodes / kl_horizon)
    `kl` is the mean per-sequence KL of the update, `num_episodes` the episodes it used: the coefficient grows
    when the policy drifts past the target and shrinks when it stays closer.
    """
    error = min(max(kl / kl_target - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + error * num_episodes / kl_horizon)


def next_kl_coef(kl_coef: float, kl: float, args) -> float:
    """The KL coefficient for the next update: `adaptive_kl_coef` towards `args.kl_target` given this update's mean
    per-sequence `kl` (over `args.batch_size` episodes), or `kl_coef` unchanged without a `kl_target`."""
    if args.kl_target is None:
        return kl_coef
    return adaptive_kl_coef(kl_coef, kl, args.kl_target, args.kl_horizon, args.batch_size)

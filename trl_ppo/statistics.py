"""Statistics over the masked positions of a batch, as small pure tensor functions (no models, no I/O): mean,
variance, whitening, and the critic's explained variance. `B` episodes, `T` response tokens; a mask is a bool
tensor `[B, T]`, True where a value counts (see `ppo.py` for the masks the trainer uses)."""

from __future__ import annotations

import torch


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


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The share of the returns' variance that the critic's values explain, over the masked positions:
    `1 - Var[returns - values] / Var[returns]` (trl 0.11's `ppo/val/var_explained`, veRL's
    `critic/vf_explained_var`). 1: the values are the returns; 0: no better than predicting their mean; below 0:
    worse than that. values, returns, mask `[B, T]` -> a 0-d float32 tensor, NaN where it is undefined: fewer than
    two masked positions, or returns all equal (their variance within float32 rounding of 0)."""
    values, returns = values.float(), returns.float()
    returns_var = masked_var(returns, mask)
    # Equal returns leave a variance of rounding errors (about eps * mean square), not an exact 0.
    rounding = torch.finfo(torch.float32).eps * masked_mean(returns**2, mask)
    explained = 1.0 - masked_var(returns - values, mask) / returns_var.clamp(min=torch.finfo(torch.float32).tiny)
    return torch.where(returns_var > rounding, explained, torch.full_like(explained, float("nan")))

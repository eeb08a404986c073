"""The stats dict that trl 0.11's `step()` returned, built from what trl_ppo's update made (`EpisodeUpdate`).

Same keys and meanings: scalars as Python floats (averaged over processes), per-episode and per-token values as
NumPy arrays of this process. Per-token arrays hold response tokens only (trl 0.11's also held the prompt and
padding positions, as zeros or meaningless values).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from .. import ppo
from ..step_api import EpisodeUpdate

# trl 0.11's `ppo/...` name -> the update's per-micro-batch stat (means over all micro-batches of the update).
UPDATE_STATS = {
    "ppo/loss/policy": "loss/policy_avg",
    "ppo/loss/value": "loss/value_avg",
    "ppo/policy/entropy": "policy/entropy_avg",
    "ppo/policy/approxkl": "policy/approxkl_avg",
    "ppo/policy/policykl": "policy/policykl",
    "ppo/policy/clipfrac": "policy/clipfrac_avg",
    "ppo/policy/advantages_mean": "policy/advantages_mean",
    "ppo/returns/mean": "returns/mean",
    "ppo/returns/var": "returns/var",
    "ppo/val/vpred": "val/vpred",
    "ppo/val/error": "val/error",
    "ppo/val/clipfrac": "val/clipfrac_avg",
    "ppo/val/mean": "val/mean",
    "ppo/val/var": "val/var",
}


@torch.no_grad()
def step_stats(
    outcome: EpisodeUpdate, queries: list, responses: list, vf_coef: float, accelerator, started: float
) -> dict:
    """trl 0.11's stats of one `step()` (`started`: its `time.time()` at the start, for `time/ppo/total`)."""
    begin = time.time()
    rollout, rewards, metrics = outcome.rollout, outcome.rewards, outcome.metrics
    mask = rollout.response_mask
    local = {
        "ppo/mean_non_score_reward": ppo.masked_mean(rewards.non_score_rewards, mask),
        "ppo/mean_scores": rewards.shaped_scores.float().mean(),
        "ppo/std_scores": rewards.shaped_scores.float().std()
        if rewards.shaped_scores.numel() > 1
        else mask.new_zeros((), dtype=torch.float),
    }
    local.update({name: outcome.result.stats[key].float().mean() for name, key in UPDATE_STATS.items()})
    names = list(local)
    means = accelerator.reduce(torch.stack([local[name].float() for name in names]), reduction="mean").tolist()
    stats = dict(zip(names, means))
    stats["ppo/loss/total"] = stats["ppo/loss/policy"] + vf_coef * stats["ppo/loss/value"]
    stats["ppo/val/var_explained"] = explained_variance(stats["ppo/val/error"], stats["ppo/returns/var"])
    stats.update(
        {
            "objective/kl": metrics["objective/kl"],
            "objective/kl_dist": _array(rewards.kl.sum(1)),
            "objective/logprobs": _array(rollout.logprobs.masked_fill(~mask, 0.0)),
            "objective/ref_logprobs": _array(rollout.ref_logprobs.masked_fill(~mask, 0.0)),
            "objective/kl_coef": metrics["objective/kl_coef"],
            "objective/entropy": metrics["objective/entropy"],
            "ppo/policy/advantages": _array(_cat(outcome.result.token_stats["policy/advantages"])),
            "ppo/policy/ratio": _array(_cat(outcome.result.token_stats["policy/ratio"])),
            "ppo/learning_rate": metrics["lr"],
        }
    )
    stats.update(_length_stats("queries", queries))
    stats.update(_length_stats("responses", responses))
    timing = {f"time/ppo/{phase}": seconds for phase, seconds in outcome.seconds.items()}
    timing["time/ppo/calc_stats"] = time.time() - begin
    timing["time/ppo/total"] = time.time() - started
    return {**stats, **timing}


def explained_variance(error: float, returns_var: float) -> float:
    """`1 - error / returns_var`; NaN where the returns have no variance (a single response token, or all returns
    equal) and it is undefined. trl 0.11 gave NaN or -inf there from a tensor division; a Python one would raise
    after the update was applied."""
    return 1.0 - error / returns_var if returns_var > 0 else float("nan")


def _cat(tensors: list) -> torch.Tensor:
    return torch.cat(tensors) if tensors else torch.zeros(0)


def _length_stats(name: str, tensors: list) -> dict:
    lengths = torch.tensor([float(t.numel()) for t in tensors])
    std = lengths.std().item() if lengths.numel() > 1 else 0.0
    return {
        f"tokens/{name}_len_mean": lengths.mean().item(),
        f"tokens/{name}_len_std": std,
        f"tokens/{name}_dist": lengths.numpy(),
    }


def _array(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().float().cpu().numpy()


def scalar_stats(stats: dict) -> dict[str, float]:
    """The stats a tracker can plot as curves: the scalars, and one-element arrays as their value."""
    scalars = {}
    for key, value in stats.items():
        if isinstance(value, np.ndarray):
            if value.size != 1:
                continue
            value = value.item()
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                continue
            value = value.item()
        scalars[key] = float(value)
    return scalars

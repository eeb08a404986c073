"""The PPOv2 metrics of an update, gathered over processes, and their averaging between two logs."""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from . import estimators, ppo
from .deadlines import take_counts
from .rollout import Rollout
from .statistics import explained_variance

# Reported as of the latest update; summed over the updates since the last log (counts of events); every other
# metric is averaged over the updates since the last log.
LATEST_VALUE_METRICS = ("eps", "lr", "lr_critic", "episode", "loss/skipped_updates", "objective/kl_coef")
SUMMED_METRICS = ("env/tool_errors", "env/tool_timeouts", "calls/timeouts", "calls/retries")


def episodes_per_second(episodes: int, seconds: float) -> float:
    """`eps`: episodes per second, rounded to 3 significant digits. A float, not TRL's int, which logs 0 for any
    run slower than one episode a second (a real model on a CPU)."""
    return float(f"{episodes / max(seconds, 1e-9):.3g}")


@torch.no_grad()
def update_metrics(
    rollout: Rollout,
    rewards: ppo.Rewards,
    update_stats: dict[str, torch.Tensor],
    scores_per_reward: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
    accelerator,
    eos_token_id: int | None,
    stop_token_id: int | None,
    kl_coef: float,
    lr: float,
    report_shaped_scores: bool = False,
    skipped_updates: int | None = None,
    num_generations: int = 1,
) -> dict[str, float]:
    """PPOv2's metrics for one update and the responses' mean length, averaged (counts: summed) over all
    processes, with the KL coefficient and learning rate it used (`objective/kl_coef`, `lr`), the calls into user
    code that timed out or were retried since the previous update (`calls/timeouts`, `calls/retries`),
    `objective/shaped_scores` when `report_shaped_scores`, `loss/skipped_updates` when `skipped_updates` is given,
    and with `num_generations` > 1 `objective/frac_reward_zero_std` (the groups whose returns are all equal).

    rewards: the rollout's KL-shaped rewards; update_stats maps a metric name to its values per micro-batch `[n]`;
    scores_per_reward maps a reward name to `(scores [B], present [B] or None)`.
    """
    mask = rollout.response_mask
    non_score_reward = rewards.non_score_rewards.sum(1).mean()
    local = {
        "objective/kl": rewards.kl.sum(1).mean(),
        "objective/entropy": (-rollout.logprobs).masked_fill(~mask, 0.0).sum(1).mean(),
        "objective/non_score_reward": non_score_reward,
        "objective/rlhf_reward": non_score_reward + rollout.scores.mean(),
        "objective/scores": rollout.scores.mean(),
        "val/mean_response_length": mask.sum(1).float().mean(),  # tokens, up to and including the stop token
    }
    if stop_token_id is not None:  # how often the last turn runs out of room without stopping (as the penalty)
        local["val/missing_stop_token_frac"] = (
            (~ppo.contains_stop_token(rollout.responses, ppo.last_turn_mask(mask), stop_token_id)).float().mean()
        )
    if num_generations > 1:  # groups of consecutive episodes (`estimators`)
        returns = estimators.episode_returns(rewards.shaped_scores, rollout.turn_rewards)
        zero_std = estimators.frac_reward_zero_std(returns, mask.any(-1), num_generations)
        local["objective/frac_reward_zero_std"] = zero_std
    local.update({key: values.float().mean() for key, values in update_stats.items()})
    names = list(local)
    gathered = accelerator.gather(torch.stack([local[n].float() for n in names]).unsqueeze(0))
    metrics = dict(zip(names, gathered.mean(0).tolist()))
    ratios = accelerator.gather(update_stats.get("val/ratio", rollout.scores.new_zeros(0)).float())
    metrics["val/ratio_var"] = ratios.var().item() if ratios.numel() > 1 else 0.0
    num_eos = ((rollout.responses == eos_token_id) & mask).sum() if eos_token_id is not None else mask.new_zeros(())
    # with the calls into user code that passed their deadline, and their retries, since the previous update
    counts = torch.tensor([[int(num_eos), *take_counts()]], dtype=torch.long, device=mask.device)
    totals = accelerator.gather(counts).sum(0).tolist()
    metrics["val/num_eos_tokens"], metrics["calls/timeouts"], metrics["calls/retries"] = totals
    metrics.update(reward_metrics(scores_per_reward, accelerator))
    if report_shaped_scores:
        metrics["objective/shaped_scores"] = accelerator.gather(rewards.shaped_scores).mean().item()
    metrics["objective/kl_coef"], metrics["lr"] = kl_coef, lr
    if skipped_updates is not None:
        metrics["loss/skipped_updates"] = skipped_updates
    return metrics


@torch.no_grad()
def critic_metrics(
    values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, accelerator, turns: int | None = None
) -> dict[str, float]:
    """How well the critic predicted the returns of the update's episodes, before training on them:
    `val/explained_variance` over the model's tokens, and with `turns` (a multi-turn run's `max_turns`) also
    `val/explained_variance/turn_<k>` over the tokens of each episode's k-th turn, k = 1..turns. Each is computed on
    every process's batch and averaged over the processes where it is defined; one defined nowhere (no tokens, or
    returns all equal: `explained_variance` is NaN) is left out of the update's metrics.

    values: the rollout's values, returns: the value targets, mask: the tokens trained on, all `[B, T]`; values and
    returns are None without a critic (a critic-free `advantage_estimator`, the same on every process): no metrics.
    """
    if values is None or returns is None:
        return {}
    local = [explained_variance(values, returns, mask)]
    names = ["val/explained_variance"]
    if turns:
        turn = ppo.turn_starts(mask).long().cumsum(-1)  # [B, T] the turn of each model token, counted from 1
        local += [explained_variance(values, returns, mask & (turn == k)) for k in range(1, turns + 1)]
        names += [f"val/explained_variance/turn_{k}" for k in range(1, turns + 1)]
    gathered = accelerator.gather(torch.stack(local).unsqueeze(0))  # [processes, names]
    means = gathered.nanmean(0).tolist()
    return {name: value for name, value in zip(names, means) if not math.isnan(value)}


def reward_metrics(scores_per_reward: dict, accelerator) -> dict[str, float]:
    """`objective/scores/<name>`: each reward's mean over the episodes it scored, over all processes; for a
    reward function also `objective/missing_scores/<name>`, the number of episodes it returned None for."""
    metrics = {}
    for name, (scores, present) in scores_per_reward.items():
        scored = torch.ones_like(scores, dtype=torch.bool) if present is None else present
        scored_sum = scores.float().masked_fill(~scored, 0.0).sum()
        local = torch.stack([scored_sum, scored.float().sum(), scored_sum.new_tensor(float(scores.numel()))])
        total, count, episodes = accelerator.gather(local.unsqueeze(0)).sum(0).tolist()
        if count > 0:
            metrics[f"objective/scores/{name}"] = total / count
        if present is not None:
            metrics[f"objective/missing_scores/{name}"] = int(episodes - count)
    return metrics


def window_value(key: str, values: list[float]) -> float:
    """What a log reports of a metric's values over the updates since the previous log."""
    if key in LATEST_VALUE_METRICS:
        return values[-1]
    return sum(values) if key in SUMMED_METRICS else sum(values) / len(values)


class MetricsSinceLog:
    """Collects each update's metrics until the next log, then reports their means (`window_value`)."""

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = defaultdict(list)

    def add(self, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.values[key].append(value)

    def __bool__(self) -> bool:
        return bool(self.values)

    def pop(self) -> dict[str, float]:
        logs = {key: window_value(key, values) for key, values in self.values.items()}
        self.values.clear()
        return logs

    def state_dict(self) -> dict[str, list[float]]:
        return {key: list(values) for key, values in self.values.items()}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        self.values = defaultdict(list, {key: list(values) for key, values in state.items()})

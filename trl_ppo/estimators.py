"""Critic-free advantage estimators over groups of episodes, as small pure tensor functions (no models, no I/O):
GRPO (and Dr. GRPO), RLOO and REINFORCE++ with a group baseline. GAE, the estimator with a critic, is in `ppo.py`;
`advantages_for` picks one of them by the run's settings, for the trainer and for recomputed trajectories alike.

A group is `group_size` consecutive episodes of a batch: the samples of one prompt (the data side repeats each
prompt `num_generations` times, and every process's batch holds whole groups). An episode is a member of its group
when it has a token in the response mask; `truncated_episodes="mask"` empties the mask of a truncated one, which
then neither counts in its group's baseline nor gets an advantage. A group with one member left has no one to be
compared with: its baseline-subtracted return is 0. A group whose members all got the same return carries no
signal: its baseline-subtracted returns are exactly 0 (not the rounding residue of its mean). That is the advantage
itself for GRPO and RLOO without a KL in the reward; REINFORCE++'s batch whitening then shifts every token by the
batch's mean, so there such a group's advantages are equal to each other, not 0.

Each estimator gives one number per episode from its return R (its shaped score plus its per-turn rewards), spread
over its model tokens (never over tool tokens). The KL penalty in the reward (`kl_coef`) enters per the literature
of each estimator:
- 'grpo' (Shao et al. 2024; TRL's GRPOTrainer): A = (R - mean_g R) / (std_g R + 1e-4), std with Bessel's
  correction; `scale=False` is Dr. GRPO (Liu et al. 2025): A = R - mean_g R. GRPO keeps its KL in the loss
  (`kl_loss_coef`); a KL in the reward is added afterwards as each token's KL-to-go, as OpenRLHF's `group_norm`.
- 'rloo' (Kool et al. 2019; Ahmadian et al. 2024; TRL's RLOOTrainer): the sequence's reward is R plus its summed KL
  penalty, and A_i = G_i - mean_{j != i} G_j: the KL is inside the leave-one-out baseline, one number per episode.
- 'reinforce_baseline' (REINFORCE++, Hu 2025; OpenRLHF's name): A_t = (R - mean_g R) + KL-to-go_t, then whitened
  over the response tokens of the batch (this process's, as GAE's advantages are).

Shapes: `B` episodes (a multiple of `group_size`), `T` response tokens, masks bool.
"""

from __future__ import annotations

import torch

from . import ppo

ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_baseline")
CRITIC_FREE = ESTIMATORS[1:]
SCALE_REWARDS = ("group", "none")
GRPO_EPS = 1e-4  # what TRL's GRPOTrainer adds to the group's std


def uses_critic(estimator: str) -> bool:
    """Whether `advantage_estimator` needs a value function (only 'gae')."""
    return estimator not in CRITIC_FREE


def episode_returns(shaped_scores: torch.Tensor, turn_rewards: torch.Tensor | None = None) -> torch.Tensor:
    """Each episode's return R without the KL penalty: its shaped score plus its per-turn rewards.
    shaped_scores `[B]`, turn_rewards `[B, K]` or None -> `[B]`."""
    if turn_rewards is None:
        return shaped_scores
    return shaped_scores + turn_rewards.to(shaped_scores.dtype).sum(-1)


def _groups(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """`[B]` -> `[B / group_size, group_size]`, refusing a batch that is not whole groups."""
    if group_size < 1 or values.numel() % group_size:
        raise ValueError(f"{values.numel()} episodes do not split into groups of {group_size} (`num_generations`).")
    return values.reshape(-1, group_size)


def group_statistics(
    returns: torch.Tensor, members: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean, Bessel-corrected std, number of members) of each episode's group, over its members.
    returns `[B]`, members `[B]` bool -> three `[B]` tensors; the std is 0 in a group of fewer than two members."""
    grouped, present = _groups(returns, group_size), _groups(members, group_size)
    count = present.sum(-1, keepdim=True)
    mean = ppo.masked_mean(grouped, present, dim=-1).unsqueeze(-1)
    squares = ((grouped - mean) ** 2).masked_fill(~present, 0.0).sum(-1, keepdim=True)
    std = (squares / (count - 1).clamp(min=1)).sqrt()
    return tuple(stat.expand_as(grouped).reshape(-1) for stat in (mean, std, count))


def flat_groups(returns: torch.Tensor, members: torch.Tensor, group_size: int) -> torch.Tensor:
    """Whether each group has no signal for a baseline: fewer than two members, or all of them with the same
    return (compared as they are, not through a rounded mean). returns, members `[B]` -> `[B / group_size]` bool."""
    grouped, present = _groups(returns, group_size), _groups(members, group_size)
    highest = grouped.masked_fill(~present, -torch.inf).amax(-1)
    lowest = grouped.masked_fill(~present, torch.inf).amin(-1)
    return (highest <= lowest) | (present.sum(-1) < 2)


def _no_signal(advantages: torch.Tensor, returns: torch.Tensor, members: torch.Tensor, group_size: int):
    """`advantages` `[B]` with 0 for non-members and for the members of a group without signal (`flat_groups`)."""
    flat = flat_groups(returns, members, group_size).repeat_interleave(group_size)
    return advantages.masked_fill(flat | ~members, 0.0)


def grpo_advantages(returns: torch.Tensor, members: torch.Tensor, group_size: int, scale: bool = True):
    """GRPO's outcome advantage: (R - mean_g R) / (std_g R + 1e-4) (`scale`), or R - mean_g R (Dr. GRPO).
    returns `[B]`, members `[B]` bool -> `[B]`."""
    mean, std, _ = group_statistics(returns, members, group_size)
    advantages = returns - mean
    if scale:
        advantages = advantages / (std + GRPO_EPS)
    return _no_signal(advantages, returns, members, group_size)


def rloo_advantages(returns: torch.Tensor, members: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO's advantage: R_i - (sum of the other members' R) / (members - 1). returns `[B]`, members `[B]` -> `[B]`."""
    grouped, present = _groups(returns, group_size), _groups(members, group_size)
    total = grouped.masked_fill(~present, 0.0).sum(-1, keepdim=True)
    others = (present.sum(-1, keepdim=True) - 1).clamp(min=1)
    advantages = returns - ((total - grouped) / others).reshape(-1)
    return _no_signal(advantages, returns, members, group_size)


def group_mean_advantages(returns: torch.Tensor, members: torch.Tensor, group_size: int) -> torch.Tensor:
    """R - mean_g R (REINFORCE++'s group baseline, before its batch whitening). returns, members `[B]` -> `[B]`."""
    mean, _, _ = group_statistics(returns, members, group_size)
    return _no_signal(returns - mean, returns, members, group_size)


def kl_to_go(kl_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Each model token's KL penalty from itself to the episode's end (the return-to-go of the KL rewards, gamma 1;
    tool tokens add nothing). kl_rewards, response_mask `[B, T]` -> `[B, T]`, zero outside the mask."""
    kept = kl_rewards.masked_fill(~response_mask, 0.0)
    return kept.flip(-1).cumsum(-1).flip(-1).masked_fill(~response_mask, 0.0)


def group_advantages(
    estimator: str,
    returns: torch.Tensor,
    kl_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_size: int,
    scale_rewards: str = "group",
) -> ppo.Advantages:
    """The advantages of a critic-free `estimator` ('grpo', 'rloo' or 'reinforce_baseline'; the module's
    docstring): returns `[B]` (`episode_returns`), kl_rewards `[B, T]` (-kl_coef * KL per token, `Rewards.
    non_score_rewards`), response_mask `[B, T]` -> `ppo.Advantages` with `[B, T]` advantages, zero outside the
    mask, and no returns (nothing to train a value on)."""
    members = response_mask.any(-1)
    if estimator == "rloo":
        sequence = returns + kl_rewards.masked_fill(~response_mask, 0.0).sum(-1)
        advantages = rloo_advantages(sequence, members, group_size).unsqueeze(1).expand_as(kl_rewards)
    elif estimator == "grpo":
        outcome = grpo_advantages(returns, members, group_size, scale=scale_rewards == "group")
        advantages = outcome.unsqueeze(1) + kl_to_go(kl_rewards, response_mask)
    elif estimator == "reinforce_baseline":
        outcome = group_mean_advantages(returns, members, group_size)
        advantages = ppo.masked_whiten(outcome.unsqueeze(1) + kl_to_go(kl_rewards, response_mask), response_mask)
    else:
        raise ValueError(f"Unknown critic-free `advantage_estimator` {estimator!r}: use one of {CRITIC_FREE}.")
    return ppo.Advantages(advantages.masked_fill(~response_mask, 0.0), None)


def advantages_for(
    settings,
    token_rewards: torch.Tensor,
    kl_rewards: torch.Tensor | None,
    shaped_scores: torch.Tensor | None,
    turn_rewards: torch.Tensor | None,
    values: torch.Tensor | None,
    response_mask: torch.Tensor,
    truncated: torch.Tensor | None,
) -> ppo.Advantages:
    """The advantages of a batch by the estimator `settings` names (a config, or the settings written with
    trajectory records; both the trainer and `trajectories.recompute` call this): GAE (`ppo.advantages_and_returns`,
    token- or turn-level, truncated episodes bootstrapped from V with `truncated_episodes="bootstrap"`), or a
    critic-free group estimate (`group_advantages`, from the shaped scores, per-turn rewards and KL rewards).
    token_rewards, kl_rewards, values, response_mask `[B, T]`; shaped_scores, truncated `[B]`; turn_rewards `[B, K]`."""
    estimator = getattr(settings, "advantage_estimator", "gae")  # records of an older trl_ppo are GAE's
    if not uses_critic(estimator):
        returns = episode_returns(shaped_scores, turn_rewards)
        return group_advantages(estimator, returns, kl_rewards, response_mask, settings.num_generations,
                                settings.scale_rewards)  # fmt: skip
    if getattr(settings, "truncated_episodes", None) == "bootstrap" and truncated is not None:
        token_rewards = ppo.bootstrap_truncated_rewards(token_rewards, values, response_mask, truncated,
                                                        settings.gamma)  # fmt: skip
    lambdas = (settings.lam, settings.lam_value, settings.length_adaptive_lam_alpha)
    return ppo.advantages_and_returns(token_rewards, values, response_mask, settings.gamma, *lambdas,
                                      settings.gae_level)  # fmt: skip


def frac_reward_zero_std(returns: torch.Tensor, members: torch.Tensor, group_size: int) -> torch.Tensor:
    """The share of groups without signal for a group baseline (`flat_groups`: members that all got the same
    return, as TRL GRPO's `frac_reward_zero_std` counts, or fewer than two members). returns, members `[B]` -> 0-d."""
    return flat_groups(returns, members, group_size).float().mean()

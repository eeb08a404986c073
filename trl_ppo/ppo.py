"""The PPO math for language models, as small pure tensor functions (no models, no I/O): token masks, the
KL-shaped rewards, score shaping and GAE. The masked statistics (mean, variance, whitening, explained variance)
are in `statistics.py` (and importable from here), the KL estimators in `kl.py`, the losses in `losses.py`.

Shapes: `B` episodes, `T` response tokens. A response mask is a bool tensor `[B, T]` that is True on the
tokens the policy produced, up to and including the stop token, and False on the padding after it and, in a
multi-turn episode, on the tool and environment tokens between its turns (gaps the policy did not choose).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .statistics import masked_mean, masked_var, masked_whiten  # noqa: F401  (here too: `ppo.masked_mean`)

# Stored in place of a log-probability on padding positions, so that a stray use is visible (a real
# log-probability is never positive).
INVALID_LOGPROB = 1.0


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


def last_turn_mask(response_mask: torch.Tensor) -> torch.Tensor:
    """The last turn of the policy in a response mask `[B, T]`: its last run of True (the whole mask of a
    single-turn response). -> `[B, T]` bool. Length-based penalties look at it, not at earlier turns."""
    positions = torch.arange(response_mask.size(1), device=response_mask.device).expand_as(response_mask)
    before_last = positions < last_token_index(response_mask).unsqueeze(1)
    last_gap = torch.where(~response_mask & before_last, positions, -1).amax(-1, keepdim=True)
    return response_mask & (positions > last_gap)


def apply_missing_eos_penalty(
    scores: torch.Tensor, has_stop_token: torch.Tensor, missing_eos_penalty: float | None
) -> torch.Tensor:
    """Subtract `missing_eos_penalty` from the score `[B]` of every response without its stop token."""
    if missing_eos_penalty is None:
        return scores
    return scores - missing_eos_penalty * (~has_stop_token).to(scores.dtype)


# ---------------------------------------------------------------------------------------------------- rewards
@dataclass
class Rewards:
    """Per-token rewards of one rollout and their parts. `B` episodes, `T` response tokens; zero on padding."""

    rewards: torch.Tensor  # [B, T] -kl_coef * kl on every token, plus the shaped score on the last one
    kl: torch.Tensor  # [B, T] the per-token KL term
    non_score_rewards: torch.Tensor  # [B, T] -kl_coef * kl
    shaped_scores: torch.Tensor  # [B] the scores as the rewards use them (after scaling and clipping)


def kl_shaped_rewards(
    shaped_scores: torch.Tensor,
    kl: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    whiten: bool = False,
    turn_rewards: torch.Tensor | None = None,
) -> Rewards:
    """`per_token_rewards`, whitened (scale only, no mean shift) over the response tokens when `whiten`.
    shaped_scores `[B]`, kl and response_mask `[B, T]`, turn_rewards `[B, K]` or None -> `Rewards`."""
    rewards, non_score_rewards = per_token_rewards(shaped_scores, kl, response_mask, kl_coef, turn_rewards)
    if whiten:
        rewards = masked_whiten(rewards, response_mask, shift_mean=False).masked_fill(~response_mask, 0.0)
    return Rewards(rewards, kl, non_score_rewards, shaped_scores)


def per_token_rewards(
    scores: torch.Tensor,
    kl: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    turn_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards: `-kl_coef * kl` on every response token, plus the score on the last response token,
    plus each per-turn reward on the last model token of its turn (`per_turn_token_rewards`).

    The score is credited to the last token the policy produced (its stop token when it has one; in a multi-turn
    episode that ends on a tool answer, the model's last token before it). TRL's PPOv2 credited it one position
    later, on the first padding token.

    scores `[B]`, kl `[B, T]`, response_mask `[B, T]`, turn_rewards `[B, K]` or None -> (rewards `[B, T]`,
    non_score_rewards `[B, T]`), both zero outside the mask.
    """
    non_score_rewards = (-kl_coef * kl).masked_fill(~response_mask, 0.0)
    rewards = non_score_rewards.clone()
    if turn_rewards is not None:
        rewards = rewards + per_turn_token_rewards(turn_rewards, response_mask).to(rewards.dtype)
    rows = torch.arange(rewards.size(0), device=rewards.device)
    rewards[rows, last_token_index(response_mask)] += scores.to(rewards.dtype)
    return rewards, non_score_rewards


def turn_ends(response_mask: torch.Tensor) -> torch.Tensor:
    """True on the last token of each turn of the policy: each maximal run of True in a response mask `[B, T]`
    (a multi-turn episode's model tokens, separated by tool/environment tokens). -> `[B, T]` bool."""
    following = torch.nn.functional.pad(response_mask[:, 1:], (0, 1), value=False)
    return response_mask & ~following


def per_turn_token_rewards(turn_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-turn rewards placed on the last model token of their turn (`turn_ends`). turn_rewards `[B, K]`, the
    k-th for the episode's k-th turn (pad with 0 where an episode had fewer turns), response_mask `[B, T]` ->
    `[B, T]`, zero elsewhere. A reward for a turn the episode does not have is an error."""
    ends = turn_ends(response_mask)
    turns = ends.sum(-1)
    rewarded = turn_rewards.ne(0)
    beyond = rewarded & (torch.arange(turn_rewards.size(1), device=turn_rewards.device) >= turns.unsqueeze(1))
    if bool(beyond.any()):
        episode = int(beyond.any(-1).nonzero()[0])
        raise ValueError(
            f"Episode {episode} has {int(turns[episode])} model turns but a reward for turn "
            f"{int(beyond[episode].nonzero()[0]) + 1}: a per-turn reward needs a turn of the model to land on."
        )
    rows, columns = ends.nonzero(as_tuple=True)
    turn = (ends.long().cumsum(-1) - 1)[rows, columns]  # the turn that ends at each of those tokens
    given = turn < turn_rewards.size(1)
    placed = torch.zeros(response_mask.shape, dtype=turn_rewards.dtype, device=turn_rewards.device)
    placed[rows[given], columns[given]] = turn_rewards[rows[given], turn[given]]
    return placed


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
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) over the response tokens the policy chose.

    delta_t = r_t + gamma * V_{t'} - V_t,   A_t = delta_t + gamma * lam * A_{t'},   returns = A + V,
    where t' is the next position of the mask after t (the next token the policy chose). The episode ends after
    the last one (V after it is 0). Positions outside the mask are skipped, not stepped through: across a
    tool/environment span inside a response (a gap in the mask), the last model token before it bootstraps from
    the value of the first model token after it, so gamma and lam never decay over tokens the policy did not
    choose, and the result at the mask equals plain GAE on the sequence with the gaps removed.

    rewards, values, response_mask `[B, T]`, `lam` a float or one per episode `[B]` -> (advantages `[B, T]`,
    returns `[B, T]`), zero outside the mask.
    """
    rewards = rewards.masked_fill(~response_mask, 0.0)
    values = values.masked_fill(~response_mask, 0.0)
    advantages_reversed = []
    last_advantage = torch.zeros_like(rewards[:, 0])
    next_values = torch.zeros_like(values[:, 0])  # V of the next masked position (0 after the last one)
    for t in reversed(range(rewards.size(1))):
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        advantage = delta + gamma * lam * last_advantage
        advantages_reversed.append(advantage)
        chosen = response_mask[:, t]  # outside the mask, carry the next chosen token's V and A over this position
        last_advantage = torch.where(chosen, advantage, last_advantage)
        next_values = torch.where(chosen, values[:, t], next_values)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values
    return advantages.masked_fill(~response_mask, 0.0), returns.masked_fill(~response_mask, 0.0)


def length_adaptive_lam(response_mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """Length-adaptive GAE lambda (VAPO, Yue et al. 2025): `lam = 1 - 1 / (alpha * length)` per episode, so the
    advantage of a long response looks further ahead. response_mask `[B, T]` -> `[B]` (float32). Responses shorter
    than `1 / alpha` tokens would get a negative lambda: it is clamped to 0 (one-step TD advantages)."""
    lengths = response_mask.sum(-1).clamp(min=1).float()
    return (1.0 - 1.0 / (alpha * lengths)).clamp(min=0.0)


def turn_starts(response_mask: torch.Tensor) -> torch.Tensor:
    """True on the first model token of each turn (each maximal run of True) of a response mask `[B, T]`: where the
    value of the turn's state is read (the value before a token is that of the context before it). -> `[B, T]`."""
    previous = torch.nn.functional.pad(response_mask[:, :-1], (1, 0), value=False)
    return response_mask & ~previous


def compute_turn_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn-level GAE (Turn-PPO, Li et al. 2025, arXiv 2512.17008; AReaL's turn-level GAE): GAE over the turn MDP,
    whose step is a whole turn of the model, then each turn's advantage spread over its model tokens.

    For turn h of an episode with H turns: R_h = the sum of the per-token rewards on its model tokens (its KL
    terms, its per-turn tool reward, the score on the last turn), V_h = the value at its first model token (the
    state: everything before the turn, tool answers included),
    delta_h = R_h + gamma * V_{h+1} - V_h (V_{H+1} = 0),   A_h = delta_h + gamma * lam * A_{h+1},   G_h = A_h + V_h,
    so gamma and lam decay once per turn, not once per token: an early tool call sees the final score through
    (gamma * lam)^(turns after it), however many tokens the later turns have. Every model token of turn h gets
    A_h and the value target G_h; tool tokens (outside the mask) get 0 and so no gradient.

    The policy decides when to stop (a turn without a tool call ends the episode). The baseline here is V(s_h), a
    function of the state before the turn alone, and the episode's end is the terminal state (V = 0), so the
    choice to stop or to call once more is judged by its own return against that baseline, with no per-turn-index
    normalisation whose number of terms depends on where the episode stopped (the action-dependent baseline, and
    length bias, of veRL RFC #7244). Episodes cut by the budget are treated as ended, as token-level GAE does.

    rewards, values, response_mask `[B, T]`, `lam` a float or one per episode `[B]` -> (advantages `[B, T]`,
    returns `[B, T]`), zero outside the mask.
    """
    starts = turn_starts(response_mask)
    turn = (starts.long().cumsum(-1) - 1).clamp(min=0)  # [B, T] the turn of each token
    turns = starts.sum(-1)  # [B]
    width = max(int(turns.max()), 1) if turns.numel() else 1
    per_turn = torch.zeros(rewards.size(0), width, dtype=rewards.dtype, device=rewards.device)
    turn_rewards = per_turn.scatter_add(1, turn, rewards.masked_fill(~response_mask, 0.0))
    turn_values = per_turn.to(values.dtype).scatter_add(1, turn, values.masked_fill(~starts, 0.0))
    turn_mask = torch.arange(width, device=rewards.device) < turns.unsqueeze(1)
    advantages, returns = compute_gae(turn_rewards, turn_values, turn_mask, gamma, lam)
    spread = (advantages.gather(1, turn), returns.gather(1, turn))
    return tuple(part.masked_fill(~response_mask, 0.0) for part in spread)


def gae_by_level(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
    level: str = "token",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`compute_gae` (level 'token'), or with level 'turn' `compute_turn_gae` for the episodes of two turns or more
    and `compute_gae` for those of one turn, whose numbers are then exactly today's (a one-turn episode is one
    step of the turn MDP: its token-level critic is kept). Shapes as `compute_gae`."""
    token_level = compute_gae(rewards, values, response_mask, gamma, lam)
    if level == "token":
        return token_level
    several = (turn_starts(response_mask).sum(-1) > 1).unsqueeze(1)
    turn_level = compute_turn_gae(rewards, values, response_mask, gamma, lam)
    return tuple(torch.where(several, t, k) for t, k in zip(turn_level, token_level))


@dataclass
class Advantages:
    """What the update optimises towards, for one rollout: both `[B, T]`, zero on padding."""

    advantages: torch.Tensor  # GAE advantages, whitened over the response tokens (or a group estimator's)
    # GAE advantages (before whitening, with the value lambda) + values: the value targets; None without a critic
    returns: torch.Tensor | None
    policy_lam: torch.Tensor | None = None  # [B] the advantages' lambda per episode, when length-adaptive


def advantages_and_returns(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    lam_value: float | None = None,
    length_adaptive_lam_alpha: float | None = None,
    level: str = "token",
) -> Advantages:
    """`gae_by_level` (`level` 'token' or 'turn'), then the advantages whitened (zero mean, unit variance over the
    response tokens).

    Decoupled GAE (VAPO): the returns use `lam_value` (default `lam`), the advantages `lam`; with
    `length_adaptive_lam_alpha` the advantages use `length_adaptive_lam` per episode and the returns `lam`.
    rewards, values, response_mask `[B, T]` -> `Advantages`."""
    policy_lam = (
        lam if length_adaptive_lam_alpha is None else length_adaptive_lam(response_mask, length_adaptive_lam_alpha)
    )
    advantages, returns = gae_by_level(rewards, values, response_mask, gamma, policy_lam, level)
    value_lam = lam if lam_value is None else lam_value
    if length_adaptive_lam_alpha is not None or value_lam != lam:  # the returns need their own lambda
        _, returns = gae_by_level(rewards, values, response_mask, gamma, value_lam, level)
    advantages = masked_whiten(advantages, response_mask).masked_fill(~response_mask, 0.0)
    return Advantages(advantages, returns, None if length_adaptive_lam_alpha is None else policy_lam)


# ----------------------------------------------------------------------------------------- truncated episodes
def bootstrap_truncated_rewards(
    rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, truncated: torch.Tensor, gamma: float
) -> torch.Tensor:
    """Per-token rewards in which each truncated episode's last model token also gets `gamma * V` there, the
    critic's value at its last model token: GAE then bootstraps from the critic at the cut instead of treating the
    cut as the episode's end (V = 0 after it), as time-limit bootstrapping does in classic RL. V at the last token
    stands for V after it, which would need one more forward position (and, after a tool call, is a state the critic
    is never trained on). rewards, values, response_mask `[B, T]`, truncated `[B]` bool -> `[B, T]`."""
    rows = torch.arange(rewards.size(0), device=rewards.device)
    last = last_token_index(response_mask)
    cut = (truncated & response_mask.any(-1)).to(rewards.dtype)
    bootstrapped = rewards.clone()
    bootstrapped[rows, last] += gamma * values[rows, last].to(rewards.dtype) * cut
    return bootstrapped


def drop_truncated_episodes(response_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """The response mask `[B, T]` with the truncated episodes (`[B]` bool) left out: they add nothing to the
    advantages' whitening nor to the losses (DAPO's overlong filtering). -> `[B, T]` bool."""
    return response_mask & ~truncated.unsqueeze(1)

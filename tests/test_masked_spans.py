"""The PPO math of multi-turn episodes (issue 25, semantics 2 and 3): tool/environment tokens inside a response
are left out of the response mask; GAE skips them, the score and per-turn rewards land on model tokens, and
whitening and every per-token mean ignore them."""

import pytest
import torch

from trl_ppo import kl, losses, ppo

T, F = True, False


def close(actual, expected, tol=1e-5):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32), torch.as_tensor(expected, dtype=torch.float32), atol=tol, rtol=0
    )


def compacted(tensor: torch.Tensor, mask: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Each row's masked values moved to the front, right-padded with `fill`: the episode without its tool tokens."""
    width = int(mask.sum(-1).max())
    pad = torch.nn.functional.pad
    return torch.stack([pad(row[keep], (0, width - int(keep.sum())), value=fill) for row, keep in zip(tensor, mask)])


def compact_mask(mask: torch.Tensor) -> torch.Tensor:
    return compacted(mask.float(), mask).bool()


def test_gae_bootstraps_across_a_tool_span_by_hand():
    # Model token, two tool tokens, model token. The tool positions' rewards and values (9) are never read.
    rewards, values = torch.tensor([[0.0, 9.0, 9.0, 1.0]]), torch.tensor([[0.5, 9.0, 9.0, 0.7]])
    advantages, returns = ppo.compute_gae(rewards, values, torch.tensor([[T, F, F, T]]), gamma=0.9, lam=0.8)
    # A3 = 1 - 0.7 = 0.3;  A0 = 0 + 0.9 * 0.7 - 0.5 + 0.9 * 0.8 * 0.3 = 0.346 (one step, not three, across the tool)
    close(advantages, [[0.346, 0.0, 0.0, 0.3]])
    close(returns, [[0.846, 0.0, 0.0, 1.0]])


@pytest.mark.parametrize("per_episode_lam", [False, True])
def test_masked_gae_equals_plain_gae_without_the_tool_tokens(per_episode_lam):
    generator = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 10, generator=generator), torch.randn(3, 10, generator=generator)
    mask = torch.tensor(
        [
            [T, T, F, F, F, T, T, F, T, F],  # two tool spans; padding after the last model token
            [T, F, T, F, T, F, T, T, T, T],  # alternating
            [T, T, T, F, F, F, F, F, F, F],  # ends on a tool answer
        ]
    )
    lam = torch.tensor([0.95, 0.5, 0.8]) if per_episode_lam else 0.9
    advantages, returns = ppo.compute_gae(rewards, values, mask, gamma=0.99, lam=lam)
    plain = compact_mask(mask)
    expected_advantages, expected_returns = ppo.compute_gae(
        compacted(rewards, mask), compacted(values, mask), plain, gamma=0.99, lam=lam
    )
    close(compacted(advantages, mask), expected_advantages)
    close(compacted(returns, mask), expected_returns)
    assert advantages[~mask].eq(0).all() and returns[~mask].eq(0).all()


def test_gae_without_gaps_is_unchanged_bit_for_bit():
    """The single-turn path: a mask that is True up to the stop token then False gives the recursion of before."""
    generator = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(4, 7, generator=generator), torch.randn(4, 7, generator=generator)
    mask = torch.arange(7).unsqueeze(0) < torch.tensor([[7], [3], [1], [5]])
    gamma, lam = 0.97, 0.93
    advantages, returns = ppo.compute_gae(rewards, values, mask, gamma, lam)
    # The recursion as it was written before masked spans were skipped (V after each position, 0 on padding).
    r, v = rewards.masked_fill(~mask, 0.0), values.masked_fill(~mask, 0.0)
    last, reference = torch.zeros(4), []
    for t in reversed(range(7)):
        next_values = v[:, t + 1] if t + 1 < 7 else torch.zeros(4)
        last = r[:, t] + gamma * next_values - v[:, t] + gamma * lam * last
        reference.append(last)
    reference = torch.stack(reference[::-1], 1)
    assert torch.equal(advantages, reference.masked_fill(~mask, 0.0))
    assert torch.equal(returns, (reference + v).masked_fill(~mask, 0.0))


@pytest.mark.parametrize("options", [{}, {"lam_value": 0.5}, {"length_adaptive_lam_alpha": 0.5}])
def test_advantages_are_whitened_over_the_model_tokens_only(options):
    generator = torch.Generator().manual_seed(2)
    rewards, values = torch.randn(2, 8, generator=generator), torch.randn(2, 8, generator=generator)
    mask = torch.tensor([[T, T, F, F, T, T, F, F], [T, F, F, F, F, T, T, T]])
    result = ppo.advantages_and_returns(rewards, values, mask, 0.99, 0.9, **options)
    expected = ppo.advantages_and_returns(
        compacted(rewards, mask), compacted(values, mask), compact_mask(mask), 0.99, 0.9, **options
    )
    close(compacted(result.advantages, mask), expected.advantages, tol=1e-4)
    close(compacted(result.returns, mask), expected.returns)


def test_score_lands_on_the_last_model_token_when_the_episode_ends_on_a_tool_answer():
    scores, kl_values = torch.tensor([2.0]), torch.full((1, 5), 0.1)
    mask = torch.tensor([[T, T, F, F, F]])  # the model's call, then the tool's answer ends the episode
    rewards, non_score = ppo.per_token_rewards(scores, kl_values, mask, kl_coef=0.5)
    close(rewards, [[-0.05, 1.95, 0.0, 0.0, 0.0]])
    close(non_score, [[-0.05, -0.05, 0.0, 0.0, 0.0]])


def test_per_turn_rewards_land_on_the_last_model_token_of_their_turn():
    mask = torch.tensor([[T, T, F, T, F, F, T], [T, F, F, F, F, F, F]])
    assert ppo.turn_ends(mask).tolist() == [[F, T, F, T, F, F, T], [T, F, F, F, F, F, F]]
    turn_rewards = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])  # the second episode had one turn
    close(ppo.per_turn_token_rewards(turn_rewards, mask), [[0, 1, 0, 2, 0, 0, 3], [4, 0, 0, 0, 0, 0, 0]])
    rewards, _ = ppo.per_token_rewards(torch.tensor([10.0, 20.0]), torch.zeros(2, 7), mask, 0.1, turn_rewards)
    close(rewards, [[0, 1, 0, 2, 0, 0, 13], [24, 0, 0, 0, 0, 0, 0]])  # the score adds to the last turn's reward
    with pytest.raises(ValueError, match="Episode 1 has 1 model turns but a reward for turn 2"):
        ppo.per_turn_token_rewards(torch.tensor([[0.0, 0.0], [1.0, 1.0]]), mask)


def test_whitened_rewards_and_per_token_means_ignore_tool_tokens():
    """Whatever sits at the tool positions (here huge numbers) changes no loss, statistic or whitened value."""
    mask = torch.tensor([[T, F, F, T, T, F], [T, T, F, T, F, F]])

    def everything(poison: float):
        inputs = [torch.randn(2, 6, generator=torch.Generator().manual_seed(i)) for i in range(6)]
        new_lp, old_lp, advantages, new_v, old_v, returns = (x.masked_fill(~mask, poison) for x in inputs)
        results = {
            "whitened_rewards": ppo.kl_shaped_rewards(torch.ones(2), new_v, mask, 0.1, whiten=True).rewards,
            "whiten": ppo.masked_whiten(advantages, mask).masked_fill(~mask, 0),
            "per_token_kl": kl.per_token_kl(new_lp, old_lp, mask),
        }
        for mode in losses.LOSS_AGG_MODES:
            aggregate = losses.LossAggregation(mode, None, 6)
            results[f"policy {mode}"] = losses.policy_loss(new_lp, old_lp, advantages, mask, 0.2, aggregate=aggregate)
            results[f"value {mode}"] = losses.value_loss(new_v, old_v, returns, mask, 0.2, aggregate)
            results[f"entropy {mode}"] = losses.entropy_loss(new_v.abs(), mask, aggregate)
            results[f"kl {mode}"] = losses.kl_loss(new_lp, old_lp, mask, "k3", aggregate)
        return results

    clean, poisoned = everything(0.0), everything(1e4)
    for name in clean:
        torch.testing.assert_close(poisoned[name], clean[name], msg=name)


def test_the_missing_eos_penalty_looks_at_the_models_last_turn():
    mask = torch.tensor([[T, T, F, F, T, T, F], [T, T, F, T, T, T, T], [T, T, T, F, F, F, F]])
    assert ppo.last_turn_mask(mask).tolist() == [
        [F, F, F, F, T, T, F],
        [F, F, F, T, T, T, T],
        [T, T, T, F, F, F, F],  # one turn: the whole mask, as for a single-turn response
    ]
    stop = 9
    responses = torch.tensor([[1, 9, 5, 5, 2, 9, 0], [1, 9, 5, 2, 2, 2, 2], [1, 2, 9, 5, 5, 0, 0]])
    has_stop = ppo.contains_stop_token(responses, ppo.last_turn_mask(mask), stop)
    assert has_stop.tolist() == [True, False, True]  # the second stopped its first turn, not its last
    close(ppo.apply_missing_eos_penalty(torch.zeros(3), has_stop, 1.0), [0.0, -1.0, 0.0])

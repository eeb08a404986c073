"""Turn-level credit (issue 35): turn-level GAE on hand-worked numbers, no gradient through tool tokens, one-turn
episodes unchanged, the `gae_level` option checked and used by the trainer."""

import pytest
import torch
from conftest import build_trainer

from trl_ppo import losses, ppo
from trl_ppo.config_checks import validate_config

T, F = True, False
# One episode of three model turns: turn 1 = tokens 0-1, a tool answer on 2-3, turn 2 = 4-5, a tool answer on 6,
# turn 3 = 7-8, padding on 9.
THREE_TURNS = torch.tensor([[T, T, F, F, T, T, F, T, T, F]])
# Per-token rewards: a KL term on token 0, turn 1's tool reward 0.5 on its last token, turn 2's tool reward -0.2,
# the score 1.0 on the last token. The tool tokens carry junk that must be ignored.
REWARDS = torch.tensor([[-0.1, 0.5, 9.0, 9.0, 0.0, -0.2, 9.0, 0.0, 1.0, 9.0]])
# Values: read at each turn's first model token (0.2, 0.4, 0.6); junk elsewhere must not matter.
VALUES = torch.tensor([[0.2, 5.0, 5.0, 5.0, 0.4, 5.0, 5.0, 0.6, 5.0, 5.0]])


def test_turn_level_gae_of_a_three_turn_episode_by_hand():
    # R = (0.4, -0.2, 1.0), V = (0.2, 0.4, 0.6), gamma 0.9, lam 0.5 (gamma * lam = 0.45):
    # delta3 = 1.0 - 0.6 = 0.4                     A3 = 0.4                    G3 = 1.0
    # delta2 = -0.2 + 0.9 * 0.6 - 0.4 = -0.06      A2 = -0.06 + 0.45 * 0.4 = 0.12    G2 = 0.52
    # delta1 = 0.4 + 0.9 * 0.4 - 0.2 = 0.56        A1 = 0.56 + 0.45 * 0.12 = 0.614  G1 = 0.814
    advantages, returns = ppo.compute_turn_gae(REWARDS, VALUES, THREE_TURNS, gamma=0.9, lam=0.5)
    expected_advantages = torch.tensor([[0.614, 0.614, 0, 0, 0.12, 0.12, 0, 0.4, 0.4, 0]])
    expected_returns = torch.tensor([[0.814, 0.814, 0, 0, 0.52, 0.52, 0, 1.0, 1.0, 0]])
    torch.testing.assert_close(advantages, expected_advantages)
    torch.testing.assert_close(returns, expected_returns)


def test_turn_level_lambda_decays_per_turn_not_per_token():
    # A long last turn (50 tokens) after a short first turn: with zero values and lam 0.5, token-level GAE gives
    # the first turn 0.5^50 of the score; turn-level gives it 0.5^1.
    mask = torch.tensor([[T, T, F] + [T] * 50])
    rewards = torch.zeros(1, 53)
    rewards[0, -1] = 1.0
    values = torch.zeros(1, 53)
    token_level, _ = ppo.compute_gae(rewards, values, mask, gamma=1.0, lam=0.5)
    turn_level, _ = ppo.compute_turn_gae(rewards, values, mask, gamma=1.0, lam=0.5)
    assert token_level[0, 0] < 1e-14
    assert turn_level[0, 0] == 0.5 and turn_level[0, 3] == 1.0


def test_no_gradient_reaches_the_tool_tokens():
    advantages, returns = ppo.compute_turn_gae(REWARDS, VALUES, THREE_TURNS, gamma=0.9, lam=0.5)
    new_logprobs = torch.full((1, 10), -1.0, requires_grad=True)
    new_values = torch.zeros(1, 10, requires_grad=True)
    old_logprobs = torch.full((1, 10), -1.1)
    pg_loss, _ = losses.policy_loss(new_logprobs, old_logprobs, advantages, THREE_TURNS, 0.2)
    vf_loss, _ = losses.value_loss(new_values, VALUES, returns, THREE_TURNS, 10.0)
    (pg_loss + vf_loss).backward()
    tool_or_padding = ~THREE_TURNS
    assert torch.all(new_logprobs.grad[tool_or_padding] == 0) and torch.all(new_values.grad[tool_or_padding] == 0)
    assert torch.all(new_logprobs.grad[THREE_TURNS] != 0) and torch.all(new_values.grad[THREE_TURNS] != 0)


def test_one_turn_episodes_give_the_token_level_numbers_bit_for_bit():
    torch.manual_seed(0)
    mask = torch.ones(4, 12, dtype=torch.bool)
    mask[1, 7:] = False  # shorter responses, still one turn each
    mask[3, 3:] = False
    rewards, values = torch.randn(4, 12), torch.randn(4, 12)
    for options in (dict(lam=0.95), dict(lam=0.9, lam_value=1.0), dict(lam=1.0, length_adaptive_lam_alpha=0.05)):
        token = ppo.advantages_and_returns(rewards, values, mask, 1.0, **options)
        turn = ppo.advantages_and_returns(rewards, values, mask, 1.0, **options, level="turn")
        assert torch.equal(token.advantages, turn.advantages) and torch.equal(token.returns, turn.returns)


def test_a_batch_mixing_one_turn_and_three_turn_episodes():
    one_turn = torch.tensor([[T, T, T, F, F, F, F, F, F, F]])
    mask = torch.cat([THREE_TURNS, one_turn])
    rewards = torch.cat([REWARDS, torch.tensor([[0.0, 0.1, 2.0] + [0.0] * 7])])
    values = torch.cat([VALUES, torch.tensor([[0.3, 0.2, 0.1] + [0.0] * 7])])
    advantages, returns = ppo.gae_by_level(rewards, values, mask, 0.9, 0.5, "turn")
    token_advantages, token_returns = ppo.compute_gae(rewards[1:], values[1:], one_turn, 0.9, 0.5)
    assert torch.equal(advantages[1:], token_advantages) and torch.equal(returns[1:], token_returns)
    torch.testing.assert_close(advantages[0, [0, 4, 7]], torch.tensor([0.614, 0.12, 0.4]))


def test_turn_starts_and_per_episode_lambdas():
    assert ppo.turn_starts(THREE_TURNS).nonzero()[:, 1].tolist() == [0, 4, 7]
    mask = torch.cat([THREE_TURNS, THREE_TURNS])
    advantages, _ = ppo.compute_turn_gae(REWARDS.repeat(2, 1), VALUES.repeat(2, 1), mask, 0.9, torch.tensor([0.5, 0.0]))
    torch.testing.assert_close(advantages[:, 0], torch.tensor([0.614, 0.56]))  # lam 0: one-turn TD, delta1


# ------------------------------------------------------------------------------------------ in the trainer
def multi_turn_episodes(tokenizer, count=8):
    """Queries, 7-token responses of three model turns (tool tokens at 2 and 4-5 masked out), scores, masks."""
    words = "the movie was good my day felt long our trip seemed fun".split()
    queries = [torch.tensor(tokenizer(" ".join(words[i % 5 : i % 5 + 2]))["input_ids"]) for i in range(count)]
    responses = [
        torch.tensor(tokenizer(" ".join(words[i % 6 : i % 6 + 6]))["input_ids"][:6] + [tokenizer.eos_token_id])
        for i in range(count)
    ]
    masks = [torch.tensor([1, 1, 0, 1, 0, 0, 1]) for _ in range(count)]
    return queries, responses, torch.tensor([float(i % 3) - 1.0 for i in range(count)]), masks


def test_an_unknown_gae_level_or_critic_epochs_below_one_is_refused(make_config):
    with pytest.raises(ValueError, match="gae_level.*'token'"):
        validate_config(make_config(gae_level="turns"))
    with pytest.raises(ValueError, match="num_critic_epochs"):
        validate_config(make_config(num_critic_epochs=0))


@pytest.mark.parametrize("level", [{"gae_level": "turn"}, {}], ids=["turn", "default"])
def test_the_trainer_spreads_turn_level_advantages_over_each_turn(make_config, tokenizer, load_models, level):
    trainer = build_trainer(make_config(total_episodes=8, **level), tokenizer, load_models)
    update = trainer.update_on_episodes(*multi_turn_episodes(tokenizer))
    advantages, mask = update.advantages.advantages, update.rollout.response_mask
    assert torch.equal(advantages[:, 0], advantages[:, 1]) and torch.all(advantages[~mask] == 0)
    assert not torch.equal(advantages[:, 0], advantages[:, 3])  # the turns get their own advantages
    rewards, values = update.rewards.rewards, update.rollout.values
    expected = ppo.advantages_and_returns(rewards, values, mask, 1.0, 0.95, level="turn")
    assert torch.equal(advantages, expected.advantages) and torch.equal(update.advantages.returns, expected.returns)


def test_the_legacy_step_api_keeps_token_level_gae():
    from trl_ppo.legacy import PPOConfig as LegacyPPOConfig
    from trl_ppo.legacy.config import core_config

    assert core_config(LegacyPPOConfig(batch_size=4, mini_batch_size=2), None).gae_level == "token"


def _value_error(trainer, update) -> float:
    """Mean squared error of the value function, now, against the update's value targets (the turn returns)."""
    rollout = trainer.add_logprobs_and_values(update.rollout)
    mask = update.rollout.response_mask
    return float(ppo.masked_mean((rollout.values - update.advantages.returns) ** 2, mask))


def test_the_critic_warmup_trains_on_turn_level_returns_and_leaves_the_policy_alone(
    make_config, tokenizer, load_models
):
    config = make_config(gae_level="turn", critic_warmup_steps=1, total_episodes=16)
    trainer = build_trainer(config, tokenizer, load_models)
    policy = dict(trainer._models().wrapper.lm.named_parameters())
    before = {name: p.detach().clone() for name, p in policy.items()}
    update = trainer.update_on_episodes(*multi_turn_episodes(tokenizer))
    assert all(torch.equal(before[name], p) for name, p in policy.items())
    error_before = float(ppo.masked_mean((update.rollout.values - update.advantages.returns) ** 2,
                                         update.rollout.response_mask))
    assert _value_error(trainer, update) < error_before


def _one_update(make_config, tokenizer, load_models, critic_epochs):
    config = make_config(num_critic_epochs=critic_epochs, num_ppo_epochs=1, total_episodes=8, gae_level="turn")
    trainer = build_trainer(config, tokenizer, load_models)
    torch.manual_seed(0)
    update = trainer.update_on_episodes(*multi_turn_episodes(tokenizer))
    policy = {name: p.detach().clone() for name, p in trainer._models().wrapper.lm.named_parameters()}
    return policy, _value_error(trainer, update), update.metrics


@pytest.mark.slow
def test_several_critic_epochs_train_the_value_more_and_the_policy_the_same(make_config, tokenizer, load_models):
    policy_1, error_1, metrics_1 = _one_update(make_config, tokenizer, load_models, 1)
    policy_4, error_4, metrics_4 = _one_update(make_config, tokenizer, load_models, 4)
    for name, weights in policy_1.items():  # one minibatch: the same policy step either way
        torch.testing.assert_close(weights, policy_4[name], msg=name)
    assert error_4 < error_1
    # the policy's stats are those of its own minibatches only
    assert metrics_1["policy/approxkl_avg"] == pytest.approx(metrics_4["policy/approxkl_avg"])

"""The critic-free advantage estimators (`trl_ppo.estimators`) on hand-worked numbers, and GRPO's against the code
of TRL 1.12's GRPOTrainer run on the same rewards."""

import inspect
import textwrap
import types

import pytest
import torch

from trl_ppo import estimators, ppo

ALL = torch.ones(8, dtype=torch.bool)
# Two groups of 4 with ties. Group A: mean 0.5, Bessel std sqrt(1/3); group B: mean 0.5, std 1.
TIED = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 0.0, 0.0, 0.0])


def close(actual, expected, tol=1e-5):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


def no_kl(batch: int, length: int = 3):
    return torch.zeros(batch, length), torch.ones(batch, length, dtype=torch.bool)


def test_two_groups_with_ties_by_hand():
    a, b = 0.5 / ((1 / 3) ** 0.5 + 1e-4), 1 / (1 + 1e-4)  # (R - mean) / (std + 1e-4): 0.5 / 0.5775, 1 / 1.0001
    close(estimators.grpo_advantages(TIED, ALL, 4), [a, -a, -a, a, 1.5 * b, -0.5 * b, -0.5 * b, -0.5 * b])
    close(estimators.grpo_advantages(TIED, ALL, 4, scale=False), [0.5, -0.5, -0.5, 0.5, 1.5, -0.5, -0.5, -0.5])
    # leave one out: 1 - mean(0, 0, 1) = 2/3; 0 - mean(1, 0, 1) = -2/3; 2 - 0 = 2; 0 - mean(2, 0, 0) = -2/3
    close(estimators.rloo_advantages(TIED, ALL, 4), [2 / 3, -2 / 3, -2 / 3, 2 / 3, 2.0, -2 / 3, -2 / 3, -2 / 3])
    close(estimators.group_mean_advantages(TIED, ALL, 4), [0.5, -0.5, -0.5, 0.5, 1.5, -0.5, -0.5, -0.5])


def test_each_estimator_spreads_one_number_per_episode_over_its_tokens_without_kl():
    kl_rewards, mask = no_kl(8)
    mask[1, 2] = False  # a shorter response: its padding gets nothing
    for estimator, per_episode in (("grpo", estimators.grpo_advantages(TIED, ALL, 4)),
                                   ("rloo", estimators.rloo_advantages(TIED, ALL, 4))):  # fmt: skip
        advantages = estimators.group_advantages(estimator, TIED, kl_rewards, mask, 4).advantages
        assert torch.equal(advantages, per_episode.unsqueeze(1).expand(8, 3).masked_fill(~mask, 0.0))
    # REINFORCE++-baseline: the group-centred returns on every token, then whitened over the batch's tokens
    advantages = estimators.group_advantages("reinforce_baseline", TIED, kl_rewards, mask, 4)
    centred = estimators.group_mean_advantages(TIED, ALL, 4).unsqueeze(1).expand(8, 3)
    assert torch.equal(advantages.advantages, ppo.masked_whiten(centred, mask).masked_fill(~mask, 0.0))
    close(ppo.masked_mean(advantages.advantages, mask), 0.0)
    close(ppo.masked_var(advantages.advantages, mask), 1.0, tol=1e-4)
    assert advantages.returns is None  # nothing to train a value on


@pytest.mark.parametrize("estimator", estimators.CRITIC_FREE)
def test_a_group_of_identical_rewards_gets_exactly_zero(estimator):
    """0.1 three times: its float mean is not 0.1 exactly, yet the advantages are 0, not the residue / 1e-4."""
    returns = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.1, 0.4])
    members = torch.ones(6, dtype=torch.bool)
    kl_rewards, mask = no_kl(6)
    advantages = estimators.group_advantages(estimator, returns, kl_rewards, mask, 3).advantages
    if estimator == "reinforce_baseline":  # centred to exactly 0, then shifted and scaled with the whole batch
        centred = estimators.group_mean_advantages(returns, members, 3)
        assert torch.equal(centred[:3], torch.zeros(3))
        assert torch.equal(advantages, ppo.masked_whiten(centred.unsqueeze(1).expand(6, 3), mask))
        flat = estimators.group_advantages(estimator, torch.full((6,), 0.1), kl_rewards, mask, 3).advantages
        assert torch.equal(flat, torch.zeros(6, 3))  # a batch of such groups: all 0
    else:
        assert torch.equal(advantages[:3], torch.zeros(3, 3))
        assert advantages[3:].abs().sum() > 0
    assert estimators.frac_reward_zero_std(returns, members, 3) == 0.5


@pytest.mark.parametrize("estimator", estimators.CRITIC_FREE)
def test_a_group_of_one_member_is_defined_as_zero(estimator):
    """Episodes without a trained token (`truncated_episodes="mask"`) leave their group: a member left alone gets 0
    (nothing to compare with; the config refuses `num_generations=1` outright), two left are compared together."""
    returns = torch.tensor([1.0, 0.0, 5.0, 3.0, 4.0, 9.0, 9.0, 9.0])
    kl_rewards, mask = no_kl(8)
    mask[2:4] = False  # group 1: members 0 and 1
    mask[5:] = False  # group 2: member 4 alone
    advantages = estimators.group_advantages(estimator, returns, kl_rewards, mask, 4).advantages
    assert torch.equal(advantages[2:4], torch.zeros(2, 3)) and torch.equal(advantages[5:], torch.zeros(3, 3))
    first = advantages[:2, 0]
    expected = {"grpo": 0.5 / (0.5**0.5 + 1e-4), "rloo": 1.0, "reinforce_baseline": None}[estimator]
    if expected is not None:
        close(first, [expected, -expected])
        close(advantages[4], [0.0, 0.0, 0.0])
    else:  # centred [0.5, -0.5, 0] on the 9 trained tokens, whitened: mean 0, unbiased var 0.25 * 6 / 8
        scale = (0.25 * 6 / 8) ** -0.5
        close(first, [0.5 * scale, -0.5 * scale], tol=1e-4)
        close(advantages[4], [0.0, 0.0, 0.0])


def test_truncated_episodes_masked_leave_the_group_terminal_ones_stay():
    returns = torch.tensor([1.0, 0.0, -1.0, 0.0])  # episode 2 was cut (a missing-EOS penalty gave it -1)
    truncated = torch.tensor([False, False, True, False])
    kl_rewards, mask = no_kl(4)
    terminal = estimators.group_advantages("rloo", returns, kl_rewards, mask, 4).advantages[:, 0]
    close(terminal, [1 - (-1 / 3), 0 - 0.0, -1 - 1 / 3, 0 - 0.0])  # the cut episode is one of the group
    dropped = ppo.drop_truncated_episodes(mask, truncated)
    masked = estimators.group_advantages("rloo", returns, kl_rewards, dropped, 4).advantages[:, 0]
    close(masked, [1 - 0.0, 0 - 0.5, 0.0, 0 - 0.5])  # leave-one-out over the three kept; the cut one gets 0


def test_multi_turn_masks_credit_model_tokens_only_and_the_return_holds_the_turn_rewards():
    """Two episodes of one group, each model turn | tool answer | model turn; per-turn rewards join the score."""
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 0, 0, 1, 1, 0]], dtype=torch.bool)
    returns = estimators.episode_returns(torch.tensor([1.0, 0.0]), torch.tensor([[0.5, 0.0], [0.0, 0.25]]))
    close(returns, [1.5, 0.25])
    kl_rewards = torch.tensor([[-0.1, -0.2, 9.0, 9.0, -0.3, -0.4], [-0.1, 9.0, 9.0, -0.2, -0.3, 9.0]])
    kl_rewards = kl_rewards.masked_fill(~mask, 0.0)  # as `Rewards.non_score_rewards`: zero off the model's tokens
    close(estimators.kl_to_go(kl_rewards, mask), [[-1.0, -0.9, 0, 0, -0.7, -0.4], [-0.6, 0, 0, -0.5, -0.3, 0]])
    grpo = estimators.group_advantages("grpo", returns, kl_rewards, mask, 2, "none").advantages
    outcome = (1.5 - 0.25) / 2  # Dr. GRPO: R - mean R
    close(grpo, [[outcome - 1.0, outcome - 0.9, 0, 0, outcome - 0.7, outcome - 0.4],
                 [-outcome - 0.6, 0, 0, -outcome - 0.5, -outcome - 0.3, 0]])  # fmt: skip
    # RLOO: the summed KL penalty is part of each sequence's reward: 1.5 - 1.0 = 0.5 and 0.25 - 0.6 = -0.35
    rloo = estimators.group_advantages("rloo", returns, kl_rewards, mask, 2).advantages
    close(rloo, mask * torch.tensor([[0.85], [-0.85]]))


def test_the_kl_in_the_reward_follows_each_estimators_literature():
    """GRPO and REINFORCE++: the KL-to-go is added after the group baseline (OpenRLHF), so equal scores with unequal
    KL still differ token by token; RLOO: the KL is inside the baseline, one number per episode."""
    returns = torch.tensor([1.0, 1.0])
    mask = torch.ones(2, 2, dtype=torch.bool)
    kl_rewards = torch.tensor([[-0.2, -0.2], [0.0, 0.0]])
    grpo = estimators.group_advantages("grpo", returns, kl_rewards, mask, 2).advantages
    close(grpo, [[-0.4, -0.2], [0.0, 0.0]])  # the equal scores give 0; the KL-to-go stays
    rloo = estimators.group_advantages("rloo", returns, kl_rewards, mask, 2).advantages
    close(rloo, [[-0.4, -0.4], [0.4, 0.4]])  # 0.6 - 1.0 and 1.0 - 0.6
    reinforce = estimators.group_advantages("reinforce_baseline", returns, kl_rewards, mask, 2).advantages
    torch.testing.assert_close(reinforce, ppo.masked_whiten(torch.tensor([[-0.4, -0.2], [0.0, 0.0]]), mask))


def test_a_batch_that_is_not_whole_groups_is_refused():
    with pytest.raises(ValueError, match="6 episodes do not split into groups of 4"):
        estimators.grpo_advantages(torch.zeros(6), torch.ones(6, dtype=torch.bool), 4)
    with pytest.raises(ValueError, match="Unknown critic-free"):
        estimators.group_advantages("gae", torch.zeros(2), *no_kl(2), 2)


# --------------------------------------------------------------------------------------------- TRL parity
def trl_grpo_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> torch.Tensor:
    """The advantages TRL 1.12's GRPOTrainer computes from `rewards` (one reward function, weight 1): the lines of
    `_generate_and_score_completions` that do it, taken from the installed source and run as they are, with the
    `nan_to_num` that follows them there."""
    grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
    source = inspect.getsource(grpo_trainer.GRPOTrainer._generate_and_score_completions)
    first = source.index("mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)")
    last = source.index("is_std_zero = torch.isclose(std_rewards", first)
    start = source.rindex("\n", 0, first) + 1
    block = textwrap.dedent(source[start : source.rindex("\n", 0, last) + 1])
    assert "advantages = rewards - mean_grouped_rewards" in block and "(std_rewards + 1e-4)" in block
    trainer = types.SimpleNamespace(scale_rewards=scale_rewards)  # what the lines read of `self`
    scope = {"torch": torch, "nanstd": grpo_trainer.nanstd, "rewards": rewards.clone(),
             "num_generations": num_generations, "self": trainer}  # fmt: skip
    exec(compile(block, "trl GRPOTrainer (advantages)", "exec"), scope)
    return torch.nan_to_num(scope["advantages"], nan=0.0)


@pytest.mark.parametrize("scale_rewards", ["group", "none"])
def test_grpo_gives_the_advantages_trl_1_12_computes(scale_rewards):
    """One fixed batch: 3 groups of 4 (ties, one of identical rewards, one spread), rewards in float32."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, -0.3, 2.7, 0.9, 1.25])
    ours = estimators.group_advantages("grpo", rewards, *no_kl(12), 4, scale_rewards).advantages
    theirs = trl_grpo_advantages(rewards, 4, scale_rewards)
    torch.testing.assert_close(ours, theirs.unsqueeze(1).expand(12, 3))  # float32 tolerances
    assert torch.equal(ours[4:8], torch.zeros(4, 3))

"""The PPO math on tensors small enough to work out by hand (the numbers in comments are those workings)."""

import math

import pytest
import torch

from trl_ppo import kl, losses, ppo
from trl_ppo.metrics import critic_metrics
from trl_ppo.statistics import explained_variance

T, F = True, False


def close(actual, expected, tol=1e-5):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32), torch.as_tensor(expected, dtype=torch.float32), atol=tol, rtol=0
    )


def test_masked_mean_var_whiten():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    mask = torch.tensor([T, T, F, T])
    close(ppo.masked_mean(values, mask), 7 / 3)  # (1 + 2 + 4) / 3
    close(ppo.masked_var(values, mask, unbiased=False), 14 / 9)  # (16/9 + 1/9 + 25/9) / 3
    close(ppo.masked_var(values, mask), 7 / 3)  # * 3 / 2
    whitened = ppo.masked_whiten(values, mask)
    close(whitened[mask], (torch.tensor([1.0, 2.0, 4.0]) - 7 / 3) / math.sqrt(7 / 3), tol=1e-4)
    close(ppo.masked_whiten(values, mask, shift_mean=False)[0], (1 - 7 / 3) / math.sqrt(7 / 3) + 7 / 3, tol=1e-4)
    close(ppo.masked_mean(torch.tensor([[1.0, 3.0], [5.0, 7.0]]), torch.tensor([[T, F], [T, T]]), dim=1), [1.0, 6.0])


def test_whitening_a_single_token_gives_zero_not_nan():
    """A batch whose only response is one stop token must not crash or poison training with NaN."""
    assert ppo.masked_var(torch.tensor([1.0, 2.0]), torch.tensor([T, F])) == 0
    assert ppo.masked_whiten(torch.tensor([[3.0, 0.0]]), torch.tensor([[T, F]]))[0, 0] == 0


def test_explained_variance_by_hand():
    # Two episodes; the masked-out positions hold numbers that would change every result below if they counted.
    returns = torch.tensor([[1.0, 2.0, 50.0], [3.0, 6.0, -9.0]])
    values = torch.tensor([[1.0, 1.0, -7.0], [2.0, 5.0, 30.0]])
    mask = torch.tensor([[T, T, F], [T, T, F]])
    # returns 1, 2, 3, 6: mean 3, squared deviations 4 + 1 + 0 + 9 = 14, Var 14/3 (Bessel).
    # returns - values 0, 1, 1, 1: mean 3/4, squared deviations 9/16 + 3 * 1/16 = 3/4, Var 1/4.
    close(explained_variance(values, returns, mask), 1 - (1 / 4) / (14 / 3))  # = 53/56 ~ 0.946
    close(explained_variance(returns, returns, mask), 1.0)  # a perfect critic
    close(explained_variance(torch.full_like(returns, 3.0), returns, mask), 0.0)  # the returns' mean: explains none
    close(explained_variance(6.0 - returns, returns, mask), -3.0)  # mirrored: residuals 2(G - 3), Var 4 x 14/3
    assert math.isnan(explained_variance(values, torch.full_like(returns, 0.7), mask))  # equal returns: undefined
    assert math.isnan(explained_variance(values, returns, torch.tensor([[T, F, F], [F, F, F]])))  # one token
    assert math.isnan(explained_variance(values, returns, torch.zeros_like(mask)))


class OneProcess:
    def gather(self, tensor):
        return tensor


class TwoProcesses:
    """The second process's batch explains nothing (EV 0 everywhere) and has no third turn."""

    def gather(self, tensor):
        other = torch.zeros_like(tensor)
        other[0, -1] = float("nan")
        return torch.cat([tensor, other])


def test_critic_metrics_per_turn_index():
    # Episode 0: turns at tokens 0-1 and 3-4 (a tool answer at 2); episode 1: turns at 0, 2 and 4.
    mask = torch.tensor([[T, T, F, T, T], [T, F, T, F, T]])
    returns = torch.tensor([[1.0, 3.0, 0.0, 2.0, 4.0], [5.0, 0.0, 6.0, 0.0, 7.0]])
    values = torch.tensor([[1.0, 2.0, 9.0, 2.0, 4.0], [4.0, 9.0, 6.0, 9.0, 7.0]])
    metrics = critic_metrics(values, returns, mask, OneProcess(), turns=4)
    # Turn 1: returns 1, 3, 5 (Var 4), residuals 0, 1, 1 (Var 1/3). Turn 2: returns 2, 4, 6 = values: 1.
    # Turn 3: one token, undefined; turn 4: none: both left out.
    assert set(metrics) == {"val/explained_variance", "val/explained_variance/turn_1", "val/explained_variance/turn_2"}
    close(metrics["val/explained_variance/turn_1"], 1 - (1 / 3) / 4)
    close(metrics["val/explained_variance/turn_2"], 1.0)
    close(metrics["val/explained_variance"], explained_variance(values, returns, mask))
    assert set(critic_metrics(values, returns, mask, OneProcess())) == {"val/explained_variance"}  # one turn
    # Over processes: the mean where defined (the last name is undefined on the second process only).
    two = critic_metrics(values, returns, mask, TwoProcesses(), turns=2)
    close(two["val/explained_variance"], metrics["val/explained_variance"] / 2)
    close(two["val/explained_variance/turn_1"], metrics["val/explained_variance/turn_1"] / 2)
    close(two["val/explained_variance/turn_2"], 1.0)


def test_kl_estimators():
    logprobs = torch.tensor([-1.0, -2.0])
    ref_logprobs = torch.tensor([-1.5, -1.0])  # log r = ref - logprobs = [-0.5, 1]
    close(kl.kl_estimate(logprobs, ref_logprobs, "k1"), [0.5, -1.0])
    close(kl.kl_estimate(logprobs, ref_logprobs, "k3"), [math.exp(-0.5) - 1 + 0.5, math.e - 1 - 1])
    assert (kl.kl_estimate(torch.randn(100), torch.randn(100), "k3") >= 0).all()
    close(kl.kl_estimate(logprobs, ref_logprobs, "k2"), [0.125, 0.5])  # 0.5 * log r^2
    with pytest.raises(ValueError, match="KL estimator"):
        kl.kl_estimate(logprobs, ref_logprobs, "k4")


def test_score_goes_on_the_last_response_token_also_when_a_response_stops_early():
    scores = torch.tensor([2.0, 3.0])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    mask = torch.tensor([[T, T, T], [T, F, F]])  # the second response is its stop token alone
    rewards, non_score = ppo.per_token_rewards(scores, kl, mask, kl_coef=0.5)
    close(non_score, [[-0.05, -0.1, -0.15], [-0.2, 0.0, 0.0]])
    # Not one position later (TRL put it on the first padding token, index 1 of the second row).
    close(rewards, [[-0.05, -0.1, 1.85], [2.8, 0.0, 0.0]])


def test_gae_three_tokens():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    advantages, returns = ppo.compute_gae(rewards, values, torch.ones(1, 3, dtype=torch.bool), gamma=0.9, lam=0.8)
    # delta2 = 1 - 0.7 = 0.3; delta1 = 0.9*0.7 - 0.6 = 0.03; delta0 = 0.9*0.6 - 0.5 = 0.04
    # A2 = 0.3; A1 = 0.03 + 0.72*0.3 = 0.246; A0 = 0.04 + 0.72*0.246 = 0.21712
    close(advantages, [[0.21712, 0.246, 0.3]])
    close(returns, [[0.71712, 0.846, 1.0]])


def test_gae_ends_the_episode_at_the_mask():
    rewards = torch.tensor([[0.0, 1.0, 5.0]])
    values = torch.tensor([[0.5, 0.6, 9.0]])  # the last position is padding: its reward and value are ignored
    advantages, returns = ppo.compute_gae(rewards, values, torch.tensor([[T, T, F]]), gamma=0.9, lam=0.8)
    # A1 = 1 - 0.6 = 0.4; A0 = 0.9*0.6 - 0.5 + 0.72*0.4 = 0.328
    close(advantages, [[0.328, 0.4, 0.0]])
    close(returns, [[0.828, 1.0, 0.0]])


def test_clipped_policy_loss():
    new_logprobs = torch.log(torch.tensor([1.5, 0.5, 1.1]))
    old_logprobs = torch.zeros(3)
    advantages = torch.tensor([1.0, 1.0, -1.0])
    loss, stats = losses.policy_loss(new_logprobs, old_logprobs, advantages, torch.ones(3, dtype=torch.bool), 0.2)
    # per token max(-A r, -A clip(r)): max(-1.5, -1.2) = -1.2 (clipped); max(-0.5, -0.8) = -0.5; max(1.1, 1.1)
    close(loss, (-1.2 - 0.5 + 1.1) / 3)
    close(stats["clipfrac"], 1 / 3)
    close(stats["approxkl"], 0.5 * (math.log(1.5) ** 2 + math.log(0.5) ** 2 + math.log(1.1) ** 2) / 3)
    close(stats["ratio"], (1.5 + 0.5 + 1.1) / 3)


def test_policy_loss_ignores_padding_and_its_gradient_points_the_right_way():
    new_logprobs = torch.tensor([-1.0, ppo.INVALID_LOGPROB], requires_grad=True)
    loss, stats = losses.policy_loss(
        new_logprobs, torch.tensor([-1.0, -3.0]), torch.tensor([2.0, 100.0]), torch.tensor([T, F]), 0.2
    )
    close(loss, -2.0)
    close(stats["ratio"], 1.0)
    loss.backward()
    assert new_logprobs.grad[0] < 0 and new_logprobs.grad[1] == 0  # descending raises a good token's logprob


def test_clipped_value_loss():
    new_values = torch.tensor([1.0, 0.0, 0.6])
    old_values = torch.tensor([0.5, 0.5, 0.5])
    returns = torch.tensor([1.2, -1.0, 0.0])
    loss, stats = losses.value_loss(new_values, old_values, returns, torch.ones(3, dtype=torch.bool), 0.2)
    # clipped values 0.7, 0.3, 0.6 -> losses max(0.04, 0.25), max(1, 1.69), max(0.36, 0.36)
    close(loss, 0.5 * (0.25 + 1.69 + 0.36) / 3)
    close(stats["clipfrac"], 2 / 3)


def test_stop_token_truncation_and_mask():
    responses = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8]])
    close(ppo.truncate_after_stop_token(responses, stop_token_id=2, pad_token_id=0), [[5, 2, 0, 0], [5, 6, 7, 8]])
    assert ppo.response_mask_after_stop(responses, 2).tolist() == [[T, T, F, F], [T, T, T, T]]
    assert ppo.response_mask_after_stop(responses, None).all()
    assert ppo.first_true_indices(responses == 7).tolist() == [2, 2]
    assert ppo.first_true_indices(responses == 9).tolist() == [4, 4]


def test_missing_eos_penalty_uses_the_configured_stop_token():
    responses = torch.tensor([[5, 2, 0], [5, 6, 7]])
    mask = ppo.response_mask_after_stop(responses, 2)
    has_stop = ppo.contains_stop_token(responses, mask, stop_token_id=2)
    assert has_stop.tolist() == [T, F]
    close(ppo.apply_missing_eos_penalty(torch.tensor([1.0, 1.0]), has_stop, 0.5), [1.0, 0.5])
    close(ppo.apply_missing_eos_penalty(torch.tensor([1.0, 1.0]), has_stop, None), [1.0, 1.0])


def test_logprobs_and_entropy_from_logits():
    logits = torch.randn(2, 3, 5)
    tokens = torch.randint(0, 5, (2, 3))
    expected = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    close(ppo.logprobs_from_logits(logits, tokens), expected)
    close(ppo.entropy_from_logits(torch.zeros(4)), math.log(4))  # uniform over 4
    close(ppo.entropy_from_logits(torch.tensor([0.0, -1e4])), 0.0)


def test_one_log_ratio_convention_for_every_kl_term():
    """`kl_estimate` and `kl_penalty` both read log_ratio = logprobs - ref_logprobs (log pi / pi_ref)."""
    logprobs, ref_logprobs = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])  # log_ratio = [0.5, -1]
    close(kl.kl_penalty(logprobs, ref_logprobs, "kl", "k1"), [[0.5, -1.0]])
    close(kl.kl_penalty(logprobs, ref_logprobs, "abs"), [[0.5, 1.0]])
    close(kl.kl_penalty(logprobs, ref_logprobs, "mse"), [[0.125, 0.5]])
    # k3 = exp(-log_ratio) - 1 + log_ratio = [e^-0.5 - 0.5, e - 2]
    close(kl.kl_penalty(logprobs, ref_logprobs, "kl", "k3"), [[math.exp(-0.5) - 0.5, math.e - 2.0]])


def test_last_token_index_and_the_per_token_kl_on_the_mask():
    mask = torch.tensor([[T, T, T], [T, F, F], [F, F, F]])
    assert ppo.last_token_index(mask).tolist() == [2, 0, 0]  # an empty row reads index 0
    logprobs, ref = torch.tensor([[-1.0, -2.0, -3.0]] * 3), torch.tensor([[-1.5, -1.0, -3.0]] * 3)
    close(kl.per_token_kl(logprobs, ref, mask), [[0.5, -1.0, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    full = torch.full((3, 3), 7.0)  # "full" takes the exact KL given, masked the same way
    close(kl.per_token_kl(logprobs, ref, mask, "full", full_kl=full), [[7.0, 7.0, 7.0], [7.0, 0, 0], [0, 0, 0]])


def test_kl_shaped_rewards_by_hand():
    scores, kl = torch.tensor([2.0, 3.0]), torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    mask = torch.tensor([[T, T, T], [T, F, F]])
    shaped = ppo.kl_shaped_rewards(scores, kl, mask, kl_coef=0.5)
    close(shaped.rewards, [[-0.05, -0.1, 1.85], [2.8, 0.0, 0.0]])
    close(shaped.non_score_rewards, [[-0.05, -0.1, -0.15], [-0.2, 0.0, 0.0]])
    assert shaped.kl is kl and shaped.shaped_scores is scores
    # Whitened: divided by the (Bessel) standard deviation of the 4 masked rewards, mean kept, padding 0.
    values = torch.tensor([-0.05, -0.1, 1.85, 2.8])
    std = values.std().item()
    expected = (values - values.mean()) / std + values.mean()
    whitened = ppo.kl_shaped_rewards(scores, kl, mask, kl_coef=0.5, whiten=True).rewards
    close(whitened[mask], expected, tol=1e-4)
    assert whitened[1, 1:].eq(0).all()


def test_advantages_and_returns_whiten_the_advantages_not_the_returns():
    rewards, values = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]])
    result = ppo.advantages_and_returns(rewards, values, torch.ones(1, 3, dtype=torch.bool), gamma=0.9, lam=0.8)
    raw = torch.tensor([0.21712, 0.246, 0.3])  # test_gae_three_tokens' workings
    close(result.returns, [[0.71712, 0.846, 1.0]])
    close(result.advantages, [((raw - raw.mean()) / raw.std()).tolist()], tol=1e-4)


def test_pad_responses_fills_to_the_length():
    padded = ppo.pad_responses(torch.tensor([[1, 2], [3, 4]]), 4, fill=9)
    assert padded.tolist() == [[1, 2, 9, 9], [3, 4, 9, 9]]

"""The off-policy corrections' weights (`off_policy.behaviour_weights`) and the policy loss they weight, on
hand-worked numbers (issue 55)."""

import math

import pytest
import torch

from trl_ppo import losses
from trl_ppo.off_policy import behaviour_weights

T, F = True, False


def close(actual, expected, tol=1e-5):
    assert abs(float(actual) - expected) < tol, (float(actual), expected)


# Three sampled tokens and a pad: pi_prox / pi_behav = 0.5, 1.0, 4.0 on the tokens; the pad's numbers are junk.
PROXIMAL = torch.log(torch.tensor([[0.2, 0.5, 0.8, 0.9]]))
BEHAVIOUR = torch.log(torch.tensor([[0.4, 0.5, 0.2, 1e-6]]))
MASK = torch.tensor([[T, T, T, F]])


def test_decoupled_weights_are_the_raw_ratio():
    weights, stats = behaviour_weights(PROXIMAL, BEHAVIOUR, MASK, "decoupled")
    assert torch.allclose(weights, torch.tensor([[0.5, 1.0, 4.0, 1.0]]))  # the pad: 1, not 0.9 / 1e-6
    close(stats["is_weight_mean"], (0.5 + 1.0 + 4.0) / 3)
    close(stats["is_weight_max"], 4.0)
    close(stats["is_truncated_frac"], 0.0)


def test_tis_truncates_at_the_cap_and_counts_what_it_cut():
    weights, stats = behaviour_weights(PROXIMAL, BEHAVIOUR, MASK, "tis", tis_cap=2.0)
    assert torch.allclose(weights, torch.tensor([[0.5, 1.0, 2.0, 1.0]]))
    close(stats["is_weight_mean"], (0.5 + 1.0 + 4.0) / 3)  # the raw ratio: how stale the batch was
    close(stats["is_weight_max"], 4.0)
    close(stats["is_truncated_frac"], 1 / 3)


def test_mis_drops_the_tokens_above_the_cap_and_keeps_the_rest_unclipped():
    # AReaL's behaviour-weight cap: the weight 4.0 > C = 2 becomes 0 (not 2, as "tis" would make it); 0.5 and 1.0
    # stay as they are; the pad stays 1.
    weights, stats = behaviour_weights(PROXIMAL, BEHAVIOUR, MASK, "mis", tis_cap=2.0)
    assert torch.allclose(weights, torch.tensor([[0.5, 1.0, 0.0, 1.0]]))
    close(stats["is_weight_mean"], (0.5 + 1.0 + 4.0) / 3)
    close(stats["is_truncated_frac"], 1 / 3)
    # Under a cap above every weight, "mis" is "decoupled".
    loose, loose_stats = behaviour_weights(PROXIMAL, BEHAVIOUR, MASK, "mis", tis_cap=5.0)
    assert torch.allclose(loose, behaviour_weights(PROXIMAL, BEHAVIOUR, MASK, "decoupled")[0])
    close(loose_stats["is_truncated_frac"], 0.0)


def test_none_weighs_every_token_one_and_still_reports_the_ratio():
    weights, stats = behaviour_weights(PROXIMAL, BEHAVIOUR, MASK, "none")
    assert torch.equal(weights, torch.ones(1, 4))
    close(stats["is_weight_max"], 4.0)


def test_unknown_correction_is_refused():
    with pytest.raises(ValueError, match="decoupled, tis, mis, none"):
        behaviour_weights(PROXIMAL, BEHAVIOUR, MASK, "vtrace")


def weighted_three_tokens(correction: str):
    """r = pi_theta / pi_prox = 1.5, 0.5, 1.1 with A = 1, 1, -1 (clipped per-token losses -1.2, -0.5, 1.1, as in
    test_ppo_math) and pi_prox / pi_behav = 0.5, 1.0, 4.0, weighted by `correction` at C = 2 -> (the new
    log-probs, with gradients; the loss; its stats)."""
    proximal = torch.log(torch.tensor([0.2, 0.5, 0.8]))
    behaviour = torch.log(torch.tensor([0.4, 0.5, 0.2]))
    new_logprobs = (proximal + torch.log(torch.tensor([1.5, 0.5, 1.1]))).requires_grad_()
    mask = torch.ones(3, dtype=torch.bool)
    weights, _ = behaviour_weights(proximal, behaviour, mask, correction, tis_cap=2.0)
    loss, stats = losses.policy_loss(new_logprobs, proximal, torch.tensor([1.0, 1.0, -1.0]), mask, 0.2, weights=weights)
    loss.backward()
    return new_logprobs, loss.detach(), stats


def test_weighted_policy_loss_by_hand():
    # "tis" at C = 2 weighs the losses by 0.5, 1.0, 2.0: -0.6, -0.5, 2.2, token-mean over 3.
    new_logprobs, loss, stats = weighted_three_tokens("tis")
    close(loss, (-0.6 - 0.5 + 2.2) / 3)
    close(stats["ratio"], (1.5 + 0.5 + 1.1) / 3)  # the ratio against the proximal policy, unweighted
    # d/dlogp of w * (-A r) where unclipped is active: -w A r / 3; token 0 is clipped (no gradient)
    close(new_logprobs.grad[0], 0.0)
    close(new_logprobs.grad[1], -1.0 * 0.5 / 3)
    close(new_logprobs.grad[2], 2.0 * 1.1 / 3)


def test_a_token_mis_dropped_gets_no_gradient():
    # "mis" at C = 2 weighs them by 0.5, 1.0, 0.0: the third token's loss 1.1 is dropped, the mean still over the 3
    # tokens trained on: (-0.6 - 0.5 + 0) / 3.
    new_logprobs, loss, _ = weighted_three_tokens("mis")
    close(loss, (-0.6 - 0.5) / 3)
    close(new_logprobs.grad[1], -1.0 * 0.5 / 3)
    close(new_logprobs.grad[2], 0.0)


def test_decoupled_weight_one_when_nothing_is_stale():
    # A batch sampled by the proximal policy itself: every weight 1, the loss plain PPO's.
    logprobs = torch.log(torch.tensor([0.3, 0.6]))
    new = logprobs + math.log(1.1)
    mask = torch.ones(2, dtype=torch.bool)
    weights, stats = behaviour_weights(logprobs, logprobs, mask, "decoupled")
    plain, _ = losses.policy_loss(new, logprobs, torch.tensor([1.0, -2.0]), mask, 0.2)
    weighted, _ = losses.policy_loss(new, logprobs, torch.tensor([1.0, -2.0]), mask, 0.2, weights=weights)
    close(weighted, float(plain))
    close(stats["is_weight_mean"], 1.0)

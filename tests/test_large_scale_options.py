"""The options from large-scale RL systems (`loss_agg_mode`, clip-higher, dual-clip, entropy bonus, critic
warm-up, decoupled and length-adaptive GAE, the KL loss, k2): their math on hand-worked numbers, and what they do
to an update."""

import math

import pytest
import torch
from conftest import build_trainer
from test_ppo_math import close
from test_trainer import one_rollout

from trl_ppo import PPOTrainer, kl, losses, ppo
from trl_ppo.config_checks import validate_config
from trl_ppo.rollout import chunks, masked_response_logprobs

T, F = True, False
VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[T, T, F], [T, F, F]])  # 2 and 1 response tokens


# --------------------------------------------------------------------------------------------- aggregation
@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 4) / 3),
        ("seq-mean-token-mean", (1.5 + 4) / 2),
        ("seq-mean-token-sum", (3 + 4) / 2),
        ("seq-mean-token-sum-norm", (3 / 3 + 4 / 3) / 2),  # divided by response_length 3, not by the lengths
    ],
)
def test_the_four_loss_aggregations(mode, expected):
    close(losses.aggregate_loss(VALUES, MASK, mode, response_length=3), expected)
    # With the whole batch's count as the normaliser, the rows' parts add up to the batch's loss.
    whole = losses.aggregation_count(MASK, mode)
    parts = [losses.aggregate_loss(VALUES[i : i + 1], MASK[i : i + 1], mode, whole, 3) for i in range(2)]
    close(sum(parts), expected)


def test_a_sequence_without_response_tokens_is_not_counted():
    mask = torch.tensor([[T, T, F], [F, F, F]])
    close(losses.aggregate_loss(VALUES, mask, "seq-mean-token-mean"), 1.5)
    close(losses.aggregate_loss(VALUES, mask, "seq-mean-token-sum"), 3.0)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        losses.aggregate_loss(VALUES, mask, "sum")


# ------------------------------------------------------------------------------------------- policy loss
def test_clip_higher_clips_the_ratio_asymmetrically():
    new_logprobs = torch.log(torch.tensor([1.5, 0.5, 1.1]))
    advantages = torch.tensor([1.0, -1.0, 1.0])
    mask = torch.ones(3, dtype=torch.bool)
    loss, stats = losses.policy_loss(new_logprobs, torch.zeros(3), advantages, mask, 0.2, cliprange_high=0.28)
    # max(-1.5, -1.28) = -1.28 (clipped above 1.28); max(0.5, 0.8) = 0.8 (clipped below 0.8); max(-1.1, -1.1)
    close(loss, (-1.28 + 0.8 - 1.1) / 3)
    close(stats["clipfrac"], 2 / 3)
    close(stats["clipfrac_high"], 1 / 3)
    close(stats["clipfrac_low"], 1 / 3)
    symmetric, _ = losses.policy_loss(new_logprobs, torch.zeros(3), advantages, mask, 0.2)
    close(symmetric, (-1.2 + 0.8 - 1.1) / 3)


def test_dual_clip_bounds_negative_advantages_only():
    new_logprobs = torch.log(torch.tensor([5.0, 1.1, 5.0])).requires_grad_()
    advantages = torch.tensor([-1.0, -1.0, 2.0])
    mask = torch.ones(3, dtype=torch.bool)
    loss, stats = losses.policy_loss(new_logprobs, torch.zeros(3), advantages, mask, 0.2, dual_clip=3.0)
    # A < 0, r = 5: max(5, 1.2) = 5, bounded by -A * 3 = 3.  A < 0, r = 1.1: 1.1 < 3, untouched.
    # A > 0, r = 5: max(-10, -2.4) = -2.4, never touched by the dual bound.
    close(loss, (3.0 + 1.1 - 2.4) / 3)
    close(stats["dual_clipfrac"], 1 / 3)
    loss.backward()
    assert new_logprobs.grad[0] == 0 and new_logprobs.grad[1] > 0  # the bound is a constant
    plain, _ = losses.policy_loss(new_logprobs.detach(), torch.zeros(3), advantages, mask, 0.2)
    close(plain, (5.0 + 1.1 - 2.4) / 3)


def test_entropy_bonus_is_minus_the_aggregated_entropy():
    entropy = VALUES.clone().requires_grad_()
    loss, stats = losses.entropy_loss(entropy, MASK)
    close(loss, -7 / 3)
    close(stats["entropy"], 7 / 3)
    loss.backward()
    assert (entropy.grad[MASK] < 0).all()  # descending the loss raises the entropy


# ------------------------------------------------------------------------------------------------------ GAE
def test_decoupled_gae_gives_the_returns_their_own_lambda():
    rewards, values = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.5, 0.5]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    result = ppo.advantages_and_returns(rewards, values, mask, gamma=1.0, lam=0.5, lam_value=1.0)
    # deltas 0, 0, 0.5. lam 0.5: A = 0.125, 0.25, 0.5 (whitened). lam 1: A = 0.5 each, returns = A + V = 1.
    close(result.returns, [[1.0, 1.0, 1.0]])
    close(result.advantages, ppo.masked_whiten(torch.tensor([[0.125, 0.25, 0.5]]), mask))
    same = ppo.advantages_and_returns(rewards, values, mask, gamma=1.0, lam=0.5)
    close(same.returns, [[0.625, 0.75, 1.0]])  # one lambda: returns = 0.125 + 0.5, 0.25 + 0.5, 0.5 + 0.5


def test_length_adaptive_lambda_per_sequence():
    mask = torch.tensor([[T, T, T], [T, F, F]])
    # alpha 0.5: 1 - 1 / (0.5 * 3) = 1/3; 1 - 1 / (0.5 * 1) = -1, clamped to 0.
    close(ppo.length_adaptive_lam(mask, 0.5), [1 / 3, 0.0])
    rewards = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    values = torch.full((2, 3), 0.5)
    result = ppo.advantages_and_returns(rewards, values, mask, gamma=1.0, lam=1.0, length_adaptive_lam_alpha=0.5)
    # Row 0, lam 1/3: A2 = 0.5, A1 = 0 + 0.5/3, A0 = 0 + 0.5/9. Row 1, lam 0: A0 = 1 - 0.5 = 0.5.
    raw = torch.tensor([[0.5 / 9, 0.5 / 3, 0.5], [0.5, 0.0, 0.0]])
    close(result.advantages, ppo.masked_whiten(raw, mask).masked_fill(~mask, 0.0))
    close(result.returns, [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # the returns keep lam = 1
    close(result.policy_lam, [1 / 3, 0.0])


# ----------------------------------------------------------------------------------------------------- KL
def test_k2_and_the_clamped_k3():
    logprobs, ref_logprobs = torch.tensor([0.0, 0.0, -1.0]), torch.tensor([-30.0, 30.0, -1.5])  # log r: 30, -30, 0.5
    close(kl.kl_estimate(logprobs, ref_logprobs, "k2"), [450.0, 450.0, 0.125])
    unclamped = kl.kl_estimate(logprobs, ref_logprobs, "k3")
    assert unclamped[1] > 1e12  # exp(30): one such token would dominate a minibatch
    clamped = kl.kl_estimate(logprobs, ref_logprobs, "k3", clamp=True)
    close(clamped, [10.0, 10.0, math.exp(-0.5) - 1 + 0.5])


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_the_kl_loss_pulls_the_policy_towards_the_reference(estimator):
    new_logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref_logprobs = torch.tensor([[-1.5, -1.0]])  # log r = 0.5 (above the reference), -1 (below)
    loss, _ = losses.kl_loss(new_logprobs, ref_logprobs, torch.ones(1, 2, dtype=torch.bool), estimator)
    loss.backward()
    grad = new_logprobs.grad[0]
    assert grad[0] > 0  # descending lowers a token the policy likes more than the reference
    if estimator == "k1":
        close(grad, [0.5, 0.5])  # k1's gradient ignores the reference: its expectation is 0 on-policy
    else:
        assert grad[1] < 0  # and raises one it likes less


# -------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "overrides, names",
    [
        (dict(loss_agg_mode="sum"), ["loss_agg_mode"]),
        (dict(cliprange_low=0.0), ["cliprange_low"]),
        (dict(cliprange_low=1.0), ["cliprange_low"]),
        (dict(cliprange_high=-0.1), ["cliprange_high"]),
        (dict(dual_clip=1.0), ["dual_clip"]),
        (dict(entropy_coef=-0.01), ["entropy_coef"]),
        (dict(critic_warmup_steps=-1), ["critic_warmup_steps"]),
        (dict(lam_value=1.5), ["lam_value"]),
        (dict(length_adaptive_lam_alpha=0.0), ["length_adaptive_lam_alpha"]),
        (dict(length_adaptive_lam_alpha=0.05, lam_value=1.0), ["length_adaptive_lam_alpha", "lam_value"]),
        (dict(kl_loss_coef=-1.0), ["kl_loss_coef"]),
        (dict(kl_loss_estimator="k4", kl_loss_coef=0.1), ["kl_loss_estimator"]),
        (dict(kl_loss_estimator="k2"), ["kl_loss_estimator", "kl_loss_coef"]),
        (dict(kl_estimator="k2", kl_penalty="abs"), ["kl_penalty", "kl_estimator"]),
    ],
)
def test_meaningless_values_and_combinations_are_refused_naming_each_option(make_config, overrides, names):
    with pytest.raises(ValueError) as error:
        validate_config(make_config(**overrides))
    assert all(f"`{name}" in str(error.value) for name in names), str(error.value)


def test_a_critic_warmup_as_long_as_the_run_is_refused(make_config, tokenizer, load_models, prompt_dataset):
    with pytest.raises(ValueError, match="critic_warmup_steps.*never trains"):
        build_trainer(make_config(critic_warmup_steps=2), tokenizer, load_models, prompt_dataset)


# ------------------------------------------------------------------------------------------------ updates
def sgd_trainer(config, tokenizer, load_models, lr, dataset=None):
    """A trainer on the tiny models (separate value model) optimised by plain SGD at `lr`, so that an update
    moves the weights by exactly lr * its gradient."""
    policy, value_model, reward_model = load_models()
    optimizer = torch.optim.SGD([*policy.parameters(), *value_model.parameters()], lr=lr)
    return PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=None,
        reward_model=reward_model,
        train_dataset=dataset,
        value_model=value_model,
        optimizers=(optimizer, None),
    )


def episodes_of_unequal_lengths(tokenizer, count=8):
    """Queries and responses whose lengths (1 to 6 tokens, the last the EOS stop token) differ within any
    micro-batch, and one score each."""
    words = "the movie was good my day felt long our trip seemed fun".split()
    queries = [torch.tensor(tokenizer(" ".join(words[i % 5 : i % 5 + 2]))["input_ids"]) for i in range(count)]
    responses = [
        torch.tensor(tokenizer(" ".join(words[i : i + i % 6]))["input_ids"] + [tokenizer.eos_token_id])
        for i in range(count)
    ]
    return queries, responses, [float(i % 3) - 1.0 for i in range(count)]


def trained_weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_token_mean_makes_gradient_accumulation_a_memory_setting(make_config, tokenizer, load_models):
    """One SGD step on responses of unequal lengths: 1 micro-batch of 8 or 4 of 2 give the same weights."""
    queries, responses, scores = episodes_of_unequal_lengths(tokenizer)
    results = []
    for per_device, accumulation in ((8, 1), (2, 4)):
        config = make_config(
            per_device_train_batch_size=per_device,
            gradient_accumulation_steps=accumulation,
            num_ppo_epochs=1,
            total_episodes=80,
            stop_token="eos",
            response_length=8,
            max_grad_norm=0.0,
        )
        trainer = sgd_trainer(config, tokenizer, load_models, lr=0.5)
        trainer.step(queries, responses, scores)
        results.append(trained_weights(trainer))
    for name in results[0]:
        torch.testing.assert_close(results[0][name], results[1][name], atol=1e-6, rtol=0, msg=name)


def reference_gradients(trainer, rollout, advantages):
    """The gradient of the update before these options: the mean over micro-batches of each micro-batch's own
    token-mean losses (`policy_loss + vf_coef * value_loss`), computed here from the same forward."""
    args, episodes = trainer.args, rollout.with_advantages(advantages).trim_padding()
    output = trainer.model(
        episodes.input_ids, episodes.attention_mask, episodes.responses, args.temperature, args.logprobs_chunk_size
    )
    new_logprobs = masked_response_logprobs(output.logprobs, episodes)
    micro_losses = []
    for part in chunks(episodes.queries.size(0), args.per_device_train_batch_size):
        micro = episodes.select(part)
        mask = micro.response_mask
        pg, _ = losses.policy_loss(new_logprobs[part], micro.logprobs, micro.advantages, mask, args.cliprange)
        vf, _ = losses.value_loss(output.values[part], micro.values, micro.returns, mask, args.cliprange_value)
        micro_losses.append(pg + args.vf_coef * vf)
    trainer.model.zero_grad()
    (sum(micro_losses) / len(micro_losses)).backward()
    return {name: p.grad.detach().clone() for name, p in trainer.model.named_parameters() if p.grad is not None}


def test_with_every_option_at_its_default_the_update_is_the_one_before_them(
    make_config, tokenizer, load_models, prompt_dataset
):
    """No stop token (every micro-batch holds the same number of tokens), one epoch of one minibatch in two
    micro-batches, SGD with lr 1 and no clipping: weights after = weights before - the old loss's gradient (1e-6)."""
    config = make_config(num_ppo_epochs=1, total_episodes=8, max_grad_norm=0.0)
    trainer = sgd_trainer(config, tokenizer, load_models, lr=1.0, dataset=prompt_dataset)
    rollout = one_rollout(trainer)
    advantages = trainer.compute_advantages(rollout, trainer.compute_rewards(rollout))
    before = trained_weights(trainer)
    trainer.model.train()
    expected = reference_gradients(trainer, rollout, advantages)
    trainer.model.zero_grad()
    trainer.ppo_update(rollout, advantages)
    after = trained_weights(trainer)
    for name, grad in expected.items():
        torch.testing.assert_close(after[name], before[name] - grad, atol=1e-6, rtol=0, msg=name)
    assert any(grad.abs().max() > 1e-4 for grad in expected.values())  # the update did move the weights


@pytest.mark.parametrize("value_model", ["separate", None], ids=["value_model", "value_head"])
def test_critic_warmup_leaves_the_policy_alone_then_trains_it(value_model, make_config, tokenizer, load_models):
    config = make_config(critic_warmup_steps=2, total_episodes=80)
    trainer = build_trainer(config, tokenizer, load_models, value_model=value_model)
    queries, responses, scores = episodes_of_unequal_lengths(tokenizer)
    wrapper = trainer._models().wrapper
    policy = {name: p for name, p in wrapper.lm.named_parameters()}
    value = [p for name, p in wrapper.named_parameters() if not any(p is q for q in policy.values())]
    policy_before = {name: p.detach().clone() for name, p in policy.items()}
    value_before = [p.detach().clone() for p in value]
    for _ in range(2):
        trainer.step(queries, responses, scores)
    assert all(torch.equal(policy_before[name], p) for name, p in policy.items())
    assert all(not trainer.optimizer.state.get(p) for p in policy.values())  # no Adam moments, no step count
    assert any(not torch.equal(before, p) for before, p in zip(value_before, value))
    trainer.step(queries, responses, scores)
    assert any(not torch.equal(policy_before[name], p) for name, p in policy.items())

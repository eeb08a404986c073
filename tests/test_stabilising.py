"""The first PPOTrainer's controls: score scaling/normalisation/clipping, KL penalty variants, early stopping,
the ratio threshold, and the step-API conveniences (length_sampler, log_stats, create_reference_model)."""

import math

import pytest
import torch
from conftest import build_trainer

from trl_ppo import create_reference_model, kl, ppo
from trl_ppo.models import decoder_blocks
from trl_ppo.rollout import reference_output


def spread(prompts, completions, **columns):
    """Scores of -3 and +3 alternately."""
    return [3.0 if i % 2 else -3.0 for i in range(len(completions))]


def weights(trainer):
    return {k: v.clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()}


def one_update(trainer, change_rollout=None):
    """Rollout, advantages and PPO update of the first batch; returns the update's stats."""
    batch = next(iter(trainer.train_dataloader))
    rollout = trainer.collect_rollout(batch)
    rollout.scores, _ = trainer.score(rollout, batch)
    if change_rollout is not None:
        change_rollout(rollout)
    advantages = trainer.compute_advantages(rollout, trainer.compute_rewards(rollout))
    return trainer.ppo_update(rollout, advantages).stats


# ------------------------------------------------------------------------------------------- score shaping
def test_shape_scores_by_hand():
    scores = torch.tensor([2.0, 4.0])
    torch.testing.assert_close(ppo.shape_scores(scores, 1.0, 2.0, True, True, None), torch.tensor([0.5, 1.5]))
    torch.testing.assert_close(ppo.shape_scores(scores, 1.0, 2.0, True, False, None), torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(ppo.shape_scores(scores, 1.0, 2.0, True, False, 1.2), torch.tensor([1.0, 1.2]))
    torch.testing.assert_close(ppo.shape_scores(-scores, 0.0, 1.0, False, False, 3.0), torch.tensor([-2.0, -3.0]))
    assert ppo.shape_scores(scores, 1.0, 2.0, False, False, None) is scores  # everything off: untouched
    torch.testing.assert_close(ppo.shape_scores(scores, 3.0, 0.0, True, True, None), torch.tensor([-1.0, 1.0]))


def test_running_moments_over_a_stream_give_unit_variance():
    torch.manual_seed(0)
    stream = [torch.randn(n) * 5.0 + 3.0 for n in (7, 16, 1, 30)]
    moments = ppo.RunningMoments()
    for batch in stream:
        moments.update(batch)
    everything = torch.cat(stream).double()
    assert moments.count == everything.numel()
    assert moments.mean == pytest.approx(everything.mean().item(), rel=1e-12)
    assert moments.std == pytest.approx(everything.std().item(), rel=1e-12)  # Bessel-corrected, as torch's
    scaled = ppo.shape_scores(everything.float(), moments.mean, moments.std, True, True, None)
    assert scaled.std().item() == pytest.approx(1.0, rel=1e-5) and abs(scaled.mean().item()) < 1e-5


def test_score_scaling_and_clipping_in_training(make_config, tokenizer, load_models, prompt_dataset):
    config = make_config(use_score_scaling=True, use_score_norm=True, score_clip=0.5, total_episodes=16)
    trainer = build_trainer(config, tokenizer, load_models, prompt_dataset, reward=spread)
    trainer.train()
    first = trainer.state.log_history[0]
    assert first["objective/scores"] == 0.0  # the raw scores are logged as they are
    assert first["objective/shaped_scores"] == pytest.approx(0.0, abs=1e-6)
    assert trainer.run.score_moments.count == 16 and trainer.run.score_moments.mean == 0.0
    assert trainer.run.score_moments.std == pytest.approx(torch.tensor([-3.0, 3.0] * 8).std().item())
    shaped = trainer._shaped_scores(torch.tensor(spread(None, [None] * 8)))
    assert shaped.abs().max().item() == 0.5  # 3 / 3.1 would be ~0.97: the clip bounds it


# ----------------------------------------------------------------------------------------- KL penalties
def test_kl_penalty_variants_by_hand():
    logprobs = torch.log(torch.tensor([[0.5, 0.2]]))
    ref_logprobs = torch.log(torch.tensor([[0.25, 0.4]]))
    log_ratio = [math.log(2.0), math.log(0.5)]
    torch.testing.assert_close(kl.kl_penalty(logprobs, ref_logprobs, "kl"), torch.tensor([log_ratio]))
    torch.testing.assert_close(kl.kl_penalty(logprobs, ref_logprobs, "abs"), torch.tensor([[math.log(2.0)] * 2]))
    torch.testing.assert_close(
        kl.kl_penalty(logprobs, ref_logprobs, "mse"), torch.tensor([[0.5 * math.log(2) ** 2] * 2])
    )
    k3 = [0.5 - 1 + math.log(2.0), 2.0 - 1 - math.log(2.0)]  # r - 1 - log r with r = pi_ref / pi
    torch.testing.assert_close(kl.kl_penalty(logprobs, ref_logprobs, "kl", "k3"), torch.tensor([k3]))
    # Full KL between p = (1/2, 1/2) and q = (1/4, 3/4): 1/2 ln 2 + 1/2 ln(2/3).
    p, q = torch.log(torch.tensor([[[0.5, 0.5]]])), torch.log(torch.tensor([[[0.25, 0.75]]]))
    expected = 0.5 * math.log(2.0) + 0.5 * math.log(2.0 / 3.0)
    torch.testing.assert_close(kl.full_kl_from_logits(p + 3.0, q - 1.0), torch.tensor([[expected]]))


def test_full_kl_chunked_equals_the_dense_computation(make_config, tokenizer, load_models, prompt_dataset):
    config = make_config(kl_penalty="full", local_rollout_forward_batch_size=3)  # chunks of 3, 3 and 2 episodes
    trainer = build_trainer(config, tokenizer, load_models, prompt_dataset, reward=spread)
    batch = next(iter(trainer.train_dataloader))
    rollout = trainer.collect_rollout(batch)
    wrapper = trainer.accelerator.unwrap_model(trainer.model)
    with torch.no_grad():
        inputs = (rollout.input_ids, rollout.attention_mask, rollout.responses, config.temperature)
        logits = wrapper(*inputs, keep_logits=True).logits
        ref_logits = reference_output(rollout, trainer._models(), trainer.args, keep_logits=True).logits
    dense = kl.full_kl_from_logits(logits, ref_logits).masked_fill(~rollout.response_mask, 0.0)
    torch.testing.assert_close(rollout.full_kl, dense)
    assert (rollout.full_kl >= -1e-6).all()
    trainer.train()  # and it trains, logging the penalty it used as objective/kl
    assert all(entry["objective/kl"] >= -1e-6 for entry in trainer.state.log_history if "objective/kl" in entry)


@pytest.mark.parametrize("penalty", ["abs", "mse"])
def test_abs_and_mse_penalties_train(penalty, make_config, tokenizer, load_models, prompt_dataset):
    trainer = build_trainer(make_config(kl_penalty=penalty), tokenizer, load_models, prompt_dataset, reward=spread)
    trainer.train()
    assert trainer.state.log_history[-2]["objective/kl"] >= 0.0  # both are never negative


# ----------------------------------------------------------------------------- early stopping, ratio guard
def test_early_stopping_stops_after_the_first_minibatch_when_target_kl_is_tiny(
    make_config, tokenizer, load_models, prompt_dataset
):
    """The first minibatch sees the sampling policy itself (KL 0) and steps; the second sees KL > 1.5 * 1e-8
    and stops the update: 1 of 4 planned minibatches ran."""
    config = make_config(early_stopping=True, target_kl=1e-8, num_ppo_epochs=2, num_mini_batches=2)
    trainer = build_trainer(config, tokenizer, load_models, prompt_dataset, reward=spread)
    stats = one_update(trainer)
    assert stats["policy/early_stop_frac"].item() == 0.25
    assert stats["policy/approxkl_avg"].numel() == 2  # one micro-batch per minibatch: two were computed
    relaxed = build_trainer(
        make_config(early_stopping=True, target_kl=1e6, num_ppo_epochs=2, num_mini_batches=2),
        tokenizer,
        load_models,
        prompt_dataset,
        reward=spread,
    )
    assert one_update(relaxed)["policy/early_stop_frac"].item() == 1.0


def test_ratio_threshold_skips_a_minibatch_with_an_injected_large_ratio(
    make_config, tokenizer, load_models, prompt_dataset
):
    def old_policy_far_less_likely(rollout):  # ratio = pi / pi_old ~ e^5 on every token
        rollout.logprobs = rollout.logprobs.masked_fill(rollout.response_mask, 0.0) + torch.where(
            rollout.response_mask, rollout.logprobs - 5.0, 0.0
        )

    config = make_config(ratio_threshold=10.0, num_ppo_epochs=1, num_mini_batches=2)
    guarded = build_trainer(config, tokenizer, load_models, prompt_dataset, reward=spread)
    before = weights(guarded)
    stats = one_update(guarded, old_policy_far_less_likely)
    assert stats["policy/skipped_minibatches"].item() == 2
    after = weights(guarded)
    assert all(torch.equal(before[k], after[k]) for k in before)  # no step was taken

    normal = build_trainer(config, tokenizer, load_models, prompt_dataset, reward=spread)
    assert one_update(normal)["policy/skipped_minibatches"].item() == 0
    assert any(not torch.equal(before[k], v) for k, v in weights(normal).items())


def test_all_controls_off_or_not_binding_give_exactly_the_core_update(
    make_config, tokenizer, load_models, prompt_dataset
):
    core = build_trainer(make_config(total_episodes=16), tokenizer, load_models, prompt_dataset, reward=spread)
    core.train()
    loose = make_config(
        total_episodes=16, early_stopping=True, target_kl=1e9, ratio_threshold=1e9, score_clip=1e9, kl_penalty="kl"
    )
    controlled = build_trainer(loose, tokenizer, load_models, prompt_dataset, reward=spread)
    controlled.train()
    a, b = weights(core), weights(controlled)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(kl_penalty="abs", kl_estimator="k3"), r"`kl_penalty='abs'` replaces the KL estimator"),
        (dict(kl_penalty="huber"), r"Unknown `kl_penalty` 'huber'"),
        (dict(use_score_norm=True), r"`use_score_norm` .* needs `use_score_scaling=True`"),
        (dict(score_clip=0.0), r"`score_clip` must be > 0"),
        (dict(target_kl=0.0), r"`target_kl` must be > 0"),
        (dict(ratio_threshold=0.5), r"`ratio_threshold` must be > 1"),
    ],
)
def test_contradictory_or_bad_controls_are_rejected(overrides, message, make_config):
    from trl_ppo.config_checks import validate_config

    with pytest.raises(ValueError, match=message):
        validate_config(make_config(**overrides))


# ---------------------------------------------------------------------------------- step API conveniences
def test_reference_sharing_the_first_layers(make_config, tokenizer, load_models, prompt_dataset):
    policy, value_model, _ = load_models()
    reference = create_reference_model(policy, num_shared_layers=1)
    shared_block, own_block = decoder_blocks(policy)[0], decoder_blocks(policy)[1]
    assert all(p is q for p, q in zip(shared_block.parameters(), decoder_blocks(reference)[0].parameters()))
    assert all(p is not q for p, q in zip(own_block.parameters(), decoder_blocks(reference)[1].parameters()))
    assert not any(p.requires_grad for p in shared_block.parameters())  # frozen in the policy too
    assert not policy.get_input_embeddings().weight.requires_grad
    shared_before = {n: p.clone() for n, p in shared_block.named_parameters()}
    own_before = {n: p.clone() for n, p in own_block.named_parameters()}

    from trl_ppo import PPOTrainer

    trainer = PPOTrainer(
        args=make_config(total_episodes=16),
        processing_class=tokenizer,
        model=policy,
        ref_model=reference,
        reward_model=spread,
        train_dataset=prompt_dataset,
        value_model=value_model,
    )
    trainer.train()
    assert all(torch.equal(p, shared_before[n]) for n, p in shared_block.named_parameters())
    assert any(not torch.equal(p, own_before[n]) for n, p in own_block.named_parameters())
    with pytest.raises(ValueError, match=r"`num_shared_layers` must be between 0 and 2"):
        create_reference_model(load_models()[0], num_shared_layers=3)


def test_length_sampler_and_log_stats(make_config, tokenizer, load_models, capsys):
    trainer = build_trainer(make_config(total_episodes=80, response_length=12), tokenizer, load_models, reward=spread)
    queries = [torch.tensor(tokenizer("the movie was")["input_ids"])] * 8
    lengths = iter([2, 3])
    responses = trainer.generate(queries, return_prompt=False, batch_size=4, length_sampler=lambda: next(lengths))
    assert max(r.numel() for r in responses[:4]) <= 2 and max(r.numel() for r in responses[4:]) <= 3
    scores = [float(r.numel()) for r in responses]
    stats = trainer.step(queries, responses, scores)
    capsys.readouterr()
    batch = {"query": ["the movie was"] * 8, "response": responses}
    trainer.log_stats(stats, batch, scores)
    shown = capsys.readouterr().out
    assert "the movie was" in shown and "reward" in shown
    assert trainer.state.log_history[-1]["objective/kl"] == pytest.approx(stats["objective/kl"])
    with pytest.raises(ValueError, match=r"the batch has no 'answer' column"):
        trainer.log_stats(stats, batch, scores, columns_to_log=("answer",))

"""The step API: `generate()` and `step(queries, responses, scores)` for episodes made outside the trainer."""

import pytest
import torch
from conftest import build_trainer


def ones(prompts, completions, **columns):
    return [1.0] * len(completions)


def policy_weights(trainer):
    return {k: v.clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()}


def hand_made_episodes(tokenizer):
    """8 queries of different lengths, responses of different lengths (one ending at EOS), and scores."""
    words = "the movie was good my day felt long".split()
    queries = [torch.tensor(tokenizer(" ".join(words[: 1 + i % 5]))["input_ids"]) for i in range(8)]
    responses = [torch.tensor(tokenizer(" ".join(words[i % 3 : i % 3 + 2 + i % 4]))["input_ids"]) for i in range(8)]
    responses[0] = torch.cat([responses[0], torch.tensor([tokenizer.eos_token_id])])
    scores = [float(i % 2) for i in range(8)]
    return queries, responses, scores


def test_step_without_a_dataset_updates_the_weights_and_returns_the_training_metrics(
    make_config, tokenizer, load_models, prompt_dataset
):
    trainer = build_trainer(make_config(total_episodes=80), tokenizer, load_models, reward=ones)
    before = policy_weights(trainer)
    queries, responses, scores = hand_made_episodes(tokenizer)
    stats = trainer.step(queries, responses, scores)
    after = policy_weights(trainer)
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("policy."))
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("value_model."))
    assert stats["objective/scores"] == pytest.approx(0.5)
    assert trainer.state.global_step == 1 and trainer.state.episode == 8

    trained = build_trainer(make_config(total_episodes=16), tokenizer, load_models, prompt_dataset, reward=ones)
    trained.train()
    per_reward = ("objective/scores/", "objective/missing_scores/")
    train_keys = {
        k for k in trained.state.log_history[0] if not k.startswith(per_reward) and k not in ("epoch", "step")
    }
    assert set(stats) == train_keys

    stats = trainer.step(queries, responses, torch.tensor(scores))  # scores as a tensor work too
    assert trainer.state.global_step == 2


def test_step_and_train_make_the_same_update_on_the_same_rollout(make_config, tokenizer, load_models, prompt_dataset):
    """Record the rollout (and RNG state) `train()` updates on; `step()` with the same episodes from the same
    initial models and RNG state ends with the same weights."""
    config = dict(total_episodes=8, num_mini_batches=2, stop_token="eos", temperature=3.0, response_length=32)
    trained = build_trainer(make_config(**config), tokenizer, load_models, prompt_dataset, reward=ones)
    recorded = {}
    compute_advantages = trained.compute_advantages

    def record(rollout, rewards):
        recorded.update(rollout=rollout, rng=torch.get_rng_state())
        return compute_advantages(rollout, rewards)

    trained.compute_advantages = record
    trained.train()
    rollout = recorded["rollout"]
    assert (~rollout.response_mask).any()  # some response stopped early: padding is part of the check
    queries = [q[m] for q, m in zip(rollout.queries, rollout.query_mask)]
    responses = [r[m] for r, m in zip(rollout.responses, rollout.response_mask)]

    stepped = build_trainer(make_config(**config), tokenizer, load_models, prompt_dataset, reward=ones)
    torch.set_rng_state(recorded["rng"])  # the minibatch order is drawn from it
    stats = stepped.step(queries, responses, rollout.scores)
    a, b = policy_weights(trained), policy_weights(stepped)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5, msg=name)
    assert stats["loss/policy_avg"] == pytest.approx(trained.state.log_history[0]["loss/policy_avg"], abs=1e-6)


def test_generate_returns_responses_cut_at_the_stop_token(make_config, tokenizer, load_models):
    trainer = build_trainer(
        make_config(total_episodes=8, stop_token="eos", temperature=3.0, response_length=12), tokenizer, load_models
    )
    queries, _, _ = hand_made_episodes(tokenizer)
    responses = trainer.generate(queries, return_prompt=False, batch_size=3)
    assert len(responses) == 8 and all(1 <= r.numel() <= 12 for r in responses)
    for response in responses:  # EOS only as the last token, if at all
        assert (response[:-1] != tokenizer.eos_token_id).all()
    with_prompt = trainer.generate(queries[0], max_new_tokens=3)
    assert with_prompt.dim() == 1 and torch.equal(with_prompt[: queries[0].numel()], queries[0])
    assert with_prompt.numel() <= queries[0].numel() + 3
    top_k = trainer.generate(queries[:2], return_prompt=False, top_k=2, max_new_tokens=4)  # transformers' generate
    assert all(1 <= r.numel() <= 4 for r in top_k)
    stats = trainer.step(queries, trainer.generate(queries, return_prompt=False), [1.0] * 8)
    assert "objective/kl" in stats


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda q, r, s: (q[:4], r[:4], s[:4]), r"got 4 episodes, but one update takes `local_batch_size` = .* = 8"),
        (lambda q, r, s: (q, r[:7], s), r"got 8 queries, 7 responses and 8 scores"),
        (lambda q, r, s: (q, r[:7] + [torch.tensor([], dtype=torch.long)], s), r"`responses\[7\]` must be a non-empty"),
        (lambda q, r, s: (q, r, s[:7] + [float("nan")]), r"non-finite score"),
    ],
)
def test_step_rejects_bad_episodes_before_any_compute(change, message, make_config, tokenizer, load_models):
    trainer = build_trainer(make_config(total_episodes=80), tokenizer, load_models, reward=ones)
    before = policy_weights(trainer)
    with pytest.raises(ValueError, match=message):
        trainer.step(*change(*hand_made_episodes(tokenizer)))
    after = policy_weights(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_without_a_dataset_total_episodes_is_required_and_train_refuses(make_config, tokenizer, load_models):
    with pytest.raises(ValueError, match=r"Without a `train_dataset` .* set `total_episodes`"):
        build_trainer(make_config(total_episodes=None), tokenizer, load_models, reward=ones)
    trainer = build_trainer(make_config(total_episodes=8), tokenizer, load_models, reward=ones)
    with pytest.raises(ValueError, match=r"`train\(\)` samples from `train_dataset`"):
        trainer.train()


def test_step_detaches_scores_that_carry_gradients(make_config, tokenizer, load_models):
    """Scores from a trainable head: with two minibatches the second backward used to fail ("backward through the
    graph a second time"), and the PPO loss's gradient reached the head."""
    trainer = build_trainer(make_config(total_episodes=80, num_mini_batches=2), tokenizer, load_models, reward=ones)
    queries, responses, _ = hand_made_episodes(tokenizer)
    head = torch.nn.Linear(1, 1)
    scores = [head(torch.tensor([float(q.numel())])).squeeze() for q in queries]
    stats = trainer.step(queries, responses, scores)
    assert trainer.state.global_step == 1 and stats["loss/policy_avg"] == stats["loss/policy_avg"]
    assert head.weight.grad is None and head.bias.grad is None


@pytest.mark.parametrize(
    "query_change, options, message",
    [
        (None, dict(batch_size=-1), r"`batch_size` .* must be a positive integer, got -1"),
        (None, dict(max_new_tokens=0), r"`max_new_tokens` must be a positive integer .* got 0"),
        (None, dict(max_new_tokens=-1), r"`max_new_tokens` must be a positive integer .* got -1"),
        (None, dict(max_new_tokens=10**6), r"`max_new_tokens` \(1000000\) exceed the model's context \(128 positions"),
        (lambda q: q[:7] + [torch.tensor([5, 10**6])], {}, r"row 7 holds token id 1000000, outside the policy"),
    ],
)
def test_generate_refuses_bad_requests_before_sampling(
    query_change, options, message, make_config, tokenizer, load_models
):
    trainer = build_trainer(make_config(total_episodes=80), tokenizer, load_models, reward=ones)
    queries, _, _ = hand_made_episodes(tokenizer)
    queries = query_change(queries) if query_change else queries
    rng = torch.get_rng_state()
    with pytest.raises(ValueError, match=message):
        trainer.generate(queries, return_prompt=False, **options)
    assert torch.equal(rng, torch.get_rng_state())  # nothing was sampled


def test_step_refuses_episodes_longer_than_the_context(make_config, tokenizer, load_models):
    """GPT-NeoX (rotary positions) trained on such an episode without a word; GPT-2 failed with an index error."""
    trainer = build_trainer(make_config(total_episodes=80), tokenizer, load_models, reward=ones)
    queries, responses, scores = hand_made_episodes(tokenizer)
    responses[3] = torch.randint(10, len(tokenizer), (129 - queries[3].numel(),))
    before = policy_weights(trainer)
    with pytest.raises(ValueError, match=r"episode 3 has \d+ query and \d+ response tokens, 129 in all, more than the "
                       r"model's context \(128 positions\)"):
        trainer.step(queries, responses, scores)
    assert all(torch.equal(before[k], v) for k, v in policy_weights(trainer).items())
    assert trainer.state.global_step == 0


def test_step_refuses_all_zero_response_masks(make_config, tokenizer, load_models):
    trainer = build_trainer(make_config(total_episodes=80), tokenizer, load_models, reward=ones)
    queries, responses, scores = hand_made_episodes(tokenizer)
    with pytest.raises(ValueError, match=r"`response_masks` are all zeros"):
        trainer.step(queries, responses, scores, response_masks=[torch.zeros_like(r) for r in responses])
    assert trainer.state.global_step == 0


def test_a_step_api_trainer_takes_a_tokenizer_without_pad_until_it_pads(make_config, tokenizer, load_models):
    """Without datasets nothing is padded at construction (trl 0.11's scripts set the pad token afterwards);
    `generate()` and `step()` refuse until one is set. With a dataset it is still refused at once (test_errors)."""
    import copy

    no_pad = copy.deepcopy(tokenizer)
    no_pad.pad_token = None
    trainer = build_trainer(make_config(total_episodes=80), no_pad, load_models, reward=ones)
    queries, responses, scores = hand_made_episodes(tokenizer)
    with pytest.raises(ValueError, match=r"no pad token, which `generate\(\)` \(it pads queries and responses\) needs"):
        trainer.generate(queries)
    with pytest.raises(ValueError, match=r"no pad token, which `step\(\)` \(it pads queries and responses\) needs"):
        trainer.step(queries, responses, scores)
    assert trainer.state.global_step == 0
    no_pad.pad_token = no_pad.eos_token
    trainer.step(queries, trainer.generate(queries, return_prompt=False, max_new_tokens=3), scores)
    assert trainer.state.global_step == 1

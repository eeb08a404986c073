"""Rewards from anywhere: reward functions (plain and async, with None), several weighted rewards, reward models
with their own tokenizer, conversational prompts, and adaptive KL control."""

import asyncio

import pytest
import torch
from conftest import build_trainer, tiny_config
from datasets import Dataset
from transformers import AutoModelForSequenceClassification

from trl_ppo.default_job import SPECIAL_TOKENS, build_word_tokenizer, default_vocabulary
from trl_ppo.kl import adaptive_kl_coef
from trl_ppo.reward_functions import call_reward_function
from trl_ppo.rewards import build_rewards, reward_model_scores


def first_batch_scores(trainer):
    batch = next(iter(trainer.train_dataloader))
    rollout = trainer.collect_rollout(batch)
    scores, per_reward = trainer.score(rollout, batch)
    return batch, rollout, scores, per_reward


def ones(prompts, completions, **columns):
    return [1.0] * len(completions)


def threes_on_odd_rows(prompts, completions, **columns):
    return [None if i % 2 == 0 else 3.0 for i in range(len(completions))]


# ------------------------------------------------------------------------------------ functions and weights
def test_weighted_rewards_sum_and_none_is_excluded_and_counted(make_config, tokenizer, load_models, prompt_dataset):
    trainer = build_trainer(
        make_config(reward_weights=[2.0, 0.5], total_episodes=8),
        tokenizer,
        load_models,
        prompt_dataset,
        reward=[ones, threes_on_odd_rows],
    )
    _, _, scores, per_reward = first_batch_scores(trainer)
    assert scores.tolist() == [2.0, 3.5] * 4  # 2 * 1 + 0.5 * (None -> 0, or 3)
    assert per_reward["threes_on_odd_rows"][1].tolist() == [False, True] * 4

    trainer.train()
    log = trainer.state.log_history[0]
    assert log["objective/scores"] == pytest.approx(2.75)
    assert log["objective/scores/ones"] == 1.0
    assert log["objective/scores/threes_on_odd_rows"] == 3.0  # the mean over the 4 scored episodes only
    assert log["objective/missing_scores/threes_on_odd_rows"] == 4
    assert log["objective/missing_scores/ones"] == 0


def test_a_reward_model_and_a_function_mix(make_config, tokenizer, load_models, prompt_dataset):
    _, _, reward_model = load_models()
    trainer = build_trainer(make_config(), tokenizer, load_models, prompt_dataset, reward=[reward_model, ones])
    _, rollout, scores, per_reward = first_batch_scores(trainer)
    model_scores = reward_model_scores(reward_model, rollout, chunk_size=4)
    torch.testing.assert_close(scores, model_scores + 1.0)
    name = type(reward_model).__name__
    assert per_reward[name][1] is None  # a model scores every episode: nothing to count as missing
    torch.testing.assert_close(per_reward[name][0], model_scores)


@pytest.mark.parametrize(
    "reward, weights, message",
    [
        ([ones, threes_on_odd_rows], [1.0], r"`reward_weights` has 1 values for 2 rewards"),
        ([], None, r"`reward_model` is an empty list"),
        ([ones, "not a reward"], None, r"sequence-classification model or a callable.*got str"),
    ],
)
def test_bad_reward_lists_fail_before_any_compute(reward, weights, message):
    with pytest.raises((ValueError, TypeError), match=message):
        build_rewards(reward, weights)


def test_rewards_of_the_same_name_get_distinct_names(load_models):
    _, _, first = load_models()
    _, _, second = load_models()
    names = [reward.name for reward in build_rewards([first, second, ones, ones])]
    assert names == [
        "GPTNeoXForSequenceClassification",
        "GPTNeoXForSequenceClassification_2",
        "ones",
        "ones_2",
    ]


def test_a_list_reward_returning_bad_values_is_named(make_config, tokenizer, load_models, prompt_dataset):
    def too_many(prompts, completions, **columns):
        return [1.0] * (len(completions) + 1)

    trainer = build_trainer(make_config(), tokenizer, load_models, prompt_dataset, reward=[ones, too_many])
    with pytest.raises(
        ValueError, match=r"Update 1: Reward function 'too_many' returned 9 scores: .* per completion, 8 here"
    ):
        trainer.train()


def test_async_reward_functions_are_awaited_also_inside_a_running_loop():
    async def judge(prompts, completions, **columns):
        await asyncio.sleep(0)
        return [float(len(c)) for c in completions]

    kwargs = dict(prompts=["a", "b"], completions=["xy", "xyz"])
    assert call_reward_function(judge, **kwargs) == [2.0, 3.0]

    async def from_a_notebook():  # an event loop is already running here, as in Jupyter
        return call_reward_function(judge, **kwargs)

    assert asyncio.run(from_a_notebook()) == [2.0, 3.0]


# ------------------------------------------------------------------------------- a reward model's own tokenizer
def other_family(tokenizer_words):
    """A tokenizer with the same words in another order (every id differs) and a reward model built on it."""
    words = list(SPECIAL_TOKENS.values()) + sorted(set(tokenizer_words) - set(SPECIAL_TOKENS.values()), reverse=True)
    reward_tokenizer = build_word_tokenizer(words + ["extra", "words"])
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_config(tiny_config("llama", reward_tokenizer))
    return reward_tokenizer, model.eval()


def decode_responses(tokenizer, rollout) -> list[str]:
    return [tokenizer.decode(r[m], skip_special_tokens=True) for r, m in zip(rollout.responses, rollout.response_mask)]


def direct_score(model, tokenizer, text: str) -> float:
    """The reward model's own pooled output for one unpadded text."""
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model(input_ids=ids).logits[0, 0].item()


def test_reward_model_with_another_vocabulary_scores_the_decoded_text(
    make_config, tokenizer, load_models, prompt_dataset
):
    reward_tokenizer, reward_model = other_family(default_vocabulary())
    assert reward_tokenizer.convert_tokens_to_ids("good") != tokenizer.convert_tokens_to_ids("good")
    trainer = build_trainer(
        make_config(),
        tokenizer,
        load_models,
        prompt_dataset,
        reward=[reward_model],
        reward_processing_class=[reward_tokenizer],
    )
    batch, rollout, scores, _ = first_batch_scores(trainer)
    expected = [
        direct_score(reward_model, reward_tokenizer, f"{prompt} {completion}")
        for prompt, completion in zip(batch["prompt"], decode_responses(tokenizer, rollout))
    ]
    torch.testing.assert_close(scores, torch.tensor(expected), atol=1e-5, rtol=1e-5)


def test_reward_tokenizer_renders_conversations_with_its_chat_template(make_config, tokenizer, load_models):
    reward_tokenizer, reward_model = other_family(default_vocabulary())
    reward_tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    messages = [[{"role": "user", "content": "the movie was"}], [{"role": "user", "content": "my day felt long"}]]
    seen = {}

    def sees_messages(prompts, completions, prompt, **columns):
        seen.update(prompts=prompts, messages=prompt)
        return [0.0] * len(completions)

    trainer = build_trainer(
        make_config(),
        tokenizer,
        load_models,
        Dataset.from_dict({"prompt": messages * 8}),
        reward=[reward_model, sees_messages],
        reward_processing_class=reward_tokenizer,
    )
    batch, rollout, scores, _ = first_batch_scores(trainer)
    # Reward functions get the messages as well as the rendered prompt text.
    assert seen["messages"] == batch["prompt"] and all(isinstance(m, list) for m in seen["messages"])
    assert seen["prompts"][0].startswith("user : ") and seen["prompts"][0].endswith("assistant :")
    expected = [
        direct_score(
            reward_model,
            reward_tokenizer,
            reward_tokenizer.apply_chat_template(m + [{"role": "assistant", "content": c}], tokenize=False),
        )
        for m, c in zip(batch["prompt"], decode_responses(tokenizer, rollout))
    ]
    torch.testing.assert_close(scores, torch.tensor(expected), atol=1e-5, rtol=1e-5)


def test_reward_processing_class_needs_one_tokenizer_per_reward_model(load_models, tokenizer):
    _, _, reward_model = load_models()
    with pytest.raises(ValueError, match=r"2 tokenizers for 1 reward models"):
        build_rewards([reward_model, ones], None, [tokenizer, tokenizer])


# ----------------------------------------------------------------------------------------- adaptive KL
def test_adaptive_kl_coef_by_hand():
    # error = clip(kl / target - 1, -0.2, 0.2); coef * (1 + error * 64 / 10000)
    assert adaptive_kl_coef(0.1, kl=12.0, kl_target=6.0, kl_horizon=10000, num_episodes=64) == pytest.approx(
        0.1 * (1 + 0.2 * 0.0064)
    )
    assert adaptive_kl_coef(0.1, kl=6.6, kl_target=6.0, kl_horizon=10000, num_episodes=64) == pytest.approx(
        0.1 * (1 + 0.1 * 0.0064)
    )
    assert adaptive_kl_coef(0.1, kl=0.0, kl_target=6.0, kl_horizon=10000, num_episodes=64) == pytest.approx(
        0.1 * (1 - 0.2 * 0.0064)
    )
    assert adaptive_kl_coef(0.1, kl=6.0, kl_target=6.0, kl_horizon=10000, num_episodes=64) == 0.1


@pytest.mark.parametrize("kl_target", [1e-6, 1e3])
def test_adaptive_kl_moves_the_coefficient_toward_the_target(
    kl_target, make_config, tokenizer, load_models, prompt_dataset
):
    """After an update whose KL is above the target the coefficient rises, below it falls (the first update has
    KL 0: policy and reference are still equal); the coefficient each update used is logged."""
    trainer = build_trainer(
        make_config(kl_target=kl_target, kl_horizon=100, kl_estimator="k3", total_episodes=32, kl_coef=0.1),
        tokenizer,
        load_models,
        prompt_dataset,
        reward=ones,
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "objective/kl_coef" in entry]
    kls = [entry["objective/kl"] for entry in logs]
    coefs = [entry["objective/kl_coef"] for entry in logs] + [trainer.run.kl_coef]
    assert coefs[0] == 0.1 and len(kls) == 4
    for sequence_kl, before, after in zip(kls, coefs, coefs[1:]):
        # |error| is clipped at 0.2 for these targets: the coefficient moves by 0.2 * 8 / 100 of itself.
        assert after == pytest.approx(before * (1 + (0.016 if sequence_kl > kl_target else -0.016))), (kls, coefs)
    # the small target is exceeded, the large one not
    assert any(sequence_kl > kl_target for sequence_kl in kls) == (kl_target < 1)


def test_fixed_kl_coef_without_a_target(make_config, tokenizer, load_models, prompt_dataset):
    trainer = build_trainer(make_config(total_episodes=16), tokenizer, load_models, prompt_dataset, reward=ones)
    trainer.train()
    assert [e["objective/kl_coef"] for e in trainer.state.log_history if "objective/kl_coef" in e] == [0.05, 0.05]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(kl_target=0.0), r"`kl_target` must be > 0"),
        (dict(kl_target=6.0, kl_coef=0.0), r"multiplies `kl_coef`, so it must be > 0"),
        (dict(kl_horizon=0), r"`kl_horizon` must be >= 1"),
    ],
)
def test_bad_adaptive_kl_settings(overrides, message, make_config, tokenizer, load_models, prompt_dataset):
    with pytest.raises(ValueError, match=message):
        build_trainer(make_config(**overrides), tokenizer, load_models, prompt_dataset, reward=ones)

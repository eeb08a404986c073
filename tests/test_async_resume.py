"""Asynchronous runs that repeat and resume (issue 68): a checkpoint resumes under another `max_staleness` (0 to k,
k to 0, k to k'), and the sampler process draws from generators of its own, so that user code drawing random
numbers while it scores cannot change what is sampled."""

import functools
import random

import numpy as np
import pytest
import torch
from conftest import needs_tool_parsing
from test_async_ppo import ASYNC, StopAfter
from test_resume import logs_without_time, make, weights

SAVING = dict(save_strategy="steps", save_steps=2, logging_steps=1)


def staleness(trainer, after: int = 2) -> list[float]:
    """The logged staleness of the updates after `after` (a resumed run's history holds those before too)."""
    logs = [entry for entry in trainer.state.log_history if "objective/kl" in entry and entry["step"] > after]
    assert len(logs) == trainer.state.global_step - after
    return [entry.get("offpolicy/staleness") for entry in logs]


def stopped_after_2(make_config, tokenizer, load_models, prompt_dataset, output_dir, **settings):
    first = make(make_config, tokenizer, load_models, prompt_dataset, [StopAfter(2)], output_dir=output_dir,
                 **(settings | SAVING))  # fmt: skip
    first.train()
    assert first.state.global_step == 2


@pytest.mark.slow  # two short runs each
@pytest.mark.parametrize("before, after, expected", [(0, 1, [0, 1, 1, 1]), (1, 2, [1, 1, 2, 2]),
                                                     (2, 1, [2, 2, 1, 1])])  # fmt: skip
def test_a_checkpoint_resumes_under_another_staleness(before, after, expected, make_config, tokenizer, load_models,
                                                      prompt_dataset, tmp_path):  # fmt: skip
    """Batches the checkpoint holds keep the version that sampled them; the batches sampled after the resume follow
    the new schedule from the weights at hand (the checkpoint's: the older ones are gone), as a fresh run does."""
    output_dir = str(tmp_path / "run")
    old = dict(ASYNC, max_staleness=before) if before else {}
    stopped_after_2(make_config, tokenizer, load_models, prompt_dataset, output_dir, **old)
    resumed = make(make_config, tokenizer, load_models, prompt_dataset, output_dir=output_dir,
                   **(ASYNC | SAVING | {"max_staleness": after}))  # fmt: skip
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6
    assert staleness(resumed) == expected


@pytest.mark.slow  # two short runs
def test_an_asynchronous_checkpoint_resumes_synchronously(make_config, tokenizer, load_models, prompt_dataset,
                                                          tmp_path, caplog):  # fmt: skip
    output_dir = str(tmp_path / "run")
    stopped_after_2(make_config, tokenizer, load_models, prompt_dataset, output_dir, **ASYNC)
    resumed = make(make_config, tokenizer, load_models, prompt_dataset, output_dir=output_dir, **SAVING)
    with caplog.at_level("WARNING"):
        resumed.train(resume_from_checkpoint=True)
    assert "1 batch(es) a sampler process sampled ahead" in caplog.text
    assert resumed.state.global_step == 6
    assert staleness(resumed) == [None] * 4  # synchronous from update 3 on


def drawing(reward):
    """`reward` that also draws from every process-wide generator, ignoring what it drew."""

    @functools.wraps(reward)  # the same name: the same logged metrics
    def scored(prompts, completions, **columns):
        torch.rand(1), np.random.rand(), random.random()
        return reward(prompts, completions, **columns)

    return scored


def good_words(prompts, completions, **columns):
    return [float(c.split().count("good")) - 0.1 * len(c.split()) for c in completions]


@pytest.mark.slow  # four short runs
def test_a_reward_that_draws_random_numbers_changes_nothing_asynchronously(make_config, tokenizer, load_models,
                                                                           prompt_dataset, tmp_path):  # fmt: skip
    """The sampler scores one batch on its main thread while the next samples on another: the sampling draws from a
    generator of its own. A reward that draws gives the run of one that does not, and so does a resumed run."""
    settings = ASYNC | SAVING
    runs = {}
    for name, reward in (("plain", good_words), ("drawing", drawing(good_words)), ("again", drawing(good_words))):
        trainer = make(make_config, tokenizer, load_models, prompt_dataset, rewards=reward,
                       output_dir=str(tmp_path / name), **settings)  # fmt: skip
        trainer.train()
        runs[name] = trainer
    output_dir = str(tmp_path / "resumed")
    stopped_after_2(make_config, tokenizer, load_models, prompt_dataset, output_dir, rewards=drawing(good_words),
                    **ASYNC)  # fmt: skip
    resumed = make(make_config, tokenizer, load_models, prompt_dataset, rewards=drawing(good_words),
                   output_dir=output_dir, **settings)  # fmt: skip
    resumed.train(resume_from_checkpoint=True)
    runs["resumed"] = resumed
    expected = logs_without_time(runs["plain"])
    for name, trainer in runs.items():
        assert logs_without_time(trainer) == expected, name
        for key, tensor in weights(runs["plain"]).items():
            assert torch.equal(tensor, weights(trainer)[key]), (name, key)


@needs_tool_parsing
@pytest.mark.slow  # three short agent runs
@pytest.mark.parametrize("agent_rollout", ["lockstep", "continuous"])
def test_agents_sampled_ahead_resume_exactly_with_a_reward_that_draws(agent_rollout, make_config, tmp_path):
    """Episodes with an environment played in the sampler process, then scored by a reward that draws random
    numbers (sampling and scoring in turn on one thread): a resumed run samples what the straight one did. In
    lockstep it ends bit for bit as the straight one; the continuous engine's forwards batch episodes as their
    tools happen to finish, so there the same episodes give log-probs equal to float32 rounding."""
    from test_async_ppo import tiny_agent_trainer

    def reward(prompts, completions, **columns):
        return [0.01 * len(c) for c in completions]

    settings = ASYNC | SAVING | {"total_episodes": 40, "agent_rollout": agent_rollout}
    straight = tiny_agent_trainer(make_config, output_dir=str(tmp_path / "a"), rewards=[drawing(reward)], **settings)
    straight.train()
    output_dir = str(tmp_path / "b")
    first = tiny_agent_trainer(make_config, callbacks=[StopAfter(2)], output_dir=output_dir,
                               rewards=[drawing(reward)], **settings)  # fmt: skip
    first.train()
    resumed = tiny_agent_trainer(make_config, output_dir=output_dir, rewards=[drawing(reward)], **settings)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == straight.state.global_step == 5
    if agent_rollout == "lockstep":
        assert logs_without_time(resumed) == logs_without_time(straight)
        for key, tensor in weights(straight).items():
            assert torch.equal(tensor, weights(resumed)[key]), key
        return
    for entry, expected in zip(logs_without_time(resumed), logs_without_time(straight), strict=True):
        assert entry == pytest.approx(expected, rel=1e-4, abs=1e-6)
        episodes = ("env/turns_mean", "env/tool_calls_mean", "val/mean_response_length", "objective/scores")
        assert [entry.get(key) for key in episodes] == [expected.get(key) for key in episodes]


def test_the_help_says_every_correction_clips_around_the_proximal_policy():
    """'none' weights each token 1; its ratio is still taken against pi_prox, never the sampler's policy."""
    from dataclasses import fields

    from trl_ppo import PPOConfig

    help_text = {field.name: field.metadata["help"] for field in fields(PPOConfig)}["off_policy_correction"]
    assert "always pi_theta / pi_prox" in help_text
    assert "'none' (1: the staleness ignored" in help_text

"""Asynchronous PPO (issue 55): `max_staleness` >= 1 samples in a process of its own, a fixed number of updates
behind, with a named off-policy correction; the refusals, the schedule, repeatability and an exact resume."""

import pytest
import torch
from test_resume import logs_without_time, make, weights
from transformers import TrainerCallback

from trl_ppo.config_checks import validate_config
from trl_ppo.rollout.asynchronous import sampling_version

ASYNC = dict(max_staleness=1, off_policy_correction="decoupled", save_strategy="no")


def test_sampling_schedule_is_exactly_k_behind():
    assert [sampling_version(batch, 1) for batch in range(1, 6)] == [0, 0, 1, 2, 3]
    assert [sampling_version(batch, 2) for batch in range(1, 6)] == [0, 0, 0, 1, 2]


def test_stale_run_without_a_named_correction_is_refused(make_config, tokenizer, load_models, prompt_dataset):
    """By the trainer, before any model is touched (`validate_config`)."""
    with pytest.raises(ValueError, match="set `off_policy_correction` to 'decoupled'"):
        make(make_config, tokenizer, load_models, prompt_dataset, max_staleness=1)
    with pytest.raises(ValueError, match="`max_staleness` must be >= 0"):
        validate_config(make_config(max_staleness=-1))
    with pytest.raises(ValueError, match="Unknown `off_policy_correction`"):
        validate_config(make_config(off_policy_correction="vtrace"))
    with pytest.raises(ValueError, match="`tis_cap` must be >= 1"):
        validate_config(make_config(off_policy_correction="tis", tis_cap=0.5))
    with pytest.warns(UserWarning, match="not corrected for"):
        validate_config(make_config(max_staleness=2, off_policy_correction="none"))


def test_what_asynchronous_sampling_cannot_run_with_is_refused(make_config, tokenizer, load_models, prompt_dataset):
    with pytest.raises(ValueError, match="kl_penalty='kl'"):
        make(make_config, tokenizer, load_models, prompt_dataset, kl_penalty="full", **ASYNC)
    trainer = make(make_config, tokenizer, load_models, prompt_dataset, **ASYNC)
    query, response = torch.tensor([5, 6]), torch.tensor([7, 8])
    with pytest.raises(ValueError, match="`step\\(\\)` trains on the episodes it is given"):
        trainer.step([query] * 8, [response] * 8, [1.0] * 8)


@pytest.mark.parametrize("correction", ["decoupled", "tis", "none"])
def test_a_stale_run_trains_k_updates_behind_and_repeats(correction, make_config, tokenizer, load_models,
                                                         prompt_dataset, tmp_path):  # fmt: skip
    """Each update's episodes come from the policy `max_staleness` updates before it (fewer at the start): the
    logged staleness says so, the behaviour and proximal log-probs differ once the policy has moved, and a second run
    with the same seed logs the same numbers."""
    settings = dict(ASYNC, max_staleness=2, off_policy_correction=correction, logging_steps=1)
    runs = []
    for name in ("a", "b"):
        with pytest.warns(UserWarning) if correction == "none" else _nothing():
            trainer = make(make_config, tokenizer, load_models, prompt_dataset, output_dir=str(tmp_path / name),
                           **settings)  # fmt: skip
        trainer.train()
        runs.append(trainer)
    logs = [entry for entry in runs[0].state.log_history if "offpolicy/staleness" in entry]
    assert [entry["offpolicy/staleness"] for entry in logs] == [0, 1, 2, 2, 2, 2]
    assert logs[0]["rollout/logprob_diff_max"] < 1e-4  # update 1: sampled by the weights it starts from
    assert logs[-1]["rollout/logprob_diff_max"] > 1e-3  # two updates on: another policy
    assert all(entry["offpolicy/is_weight_mean"] > 0 for entry in logs)
    assert logs_without_time(runs[0]) == logs_without_time(runs[1])


class StopAfter(TrainerCallback):
    def __init__(self, update: int):
        self.update = update

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.update:
            control.should_training_stop = True


def test_resume_trains_on_exactly_what_the_run_would_have(make_config, tokenizer, load_models, prompt_dataset,
                                                          tmp_path):  # fmt: skip
    """6 updates straight vs. stopped after update 2 (its checkpoint holds the batch sampled ahead) and resumed:
    the same weights and logs, bit for bit."""
    settings = dict(ASYNC, max_staleness=1, off_policy_correction="tis", save_strategy="steps", save_steps=2)
    straight = make(make_config, tokenizer, load_models, prompt_dataset, output_dir=str(tmp_path / "a"), **settings)
    straight.train()
    output_dir = str(tmp_path / "b")
    first = make(make_config, tokenizer, load_models, prompt_dataset, [StopAfter(2)], output_dir=output_dir,
                 **settings)  # fmt: skip
    first.train()
    assert first.state.global_step == 2
    resumed = make(make_config, tokenizer, load_models, prompt_dataset, output_dir=output_dir, **settings)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6
    assert logs_without_time(resumed) == logs_without_time(straight)
    for name, tensor in weights(straight).items():
        assert torch.equal(tensor, weights(resumed)[name]), name


def test_a_failing_reward_in_the_sampler_stops_the_run_with_its_traceback(make_config, tokenizer, load_models,
                                                                          prompt_dataset):  # fmt: skip
    calls = []

    def reward(prompts, completions, **columns):
        calls.append(1)
        if len(calls) > 2:  # the sampler process's third batch
            raise KeyError("the judge is down")
        return [0.0] * len(completions)

    trainer = make(make_config, tokenizer, load_models, prompt_dataset, rewards=reward, **ASYNC)
    with pytest.raises(RuntimeError, match="(?s)sampler process failed on batch 3.*the judge is down"):
        trainer.train()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

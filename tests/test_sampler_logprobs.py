"""`use_sampler_logprobs` (issue 54): the log-probs the episode engine records while it samples stand in for the
policy's no-grad forward after sampling. Refused clearly where they cannot; where they can, the run trains as
the one with the forward does (float32: the two agree to rounding) with one policy pass less per update."""

import pytest
import torch
from conftest import build_trainer, needs_tool_parsing
from test_agent_training import agent_trainer

from trl_ppo import PPOConfig
from trl_ppo.agents.tiny_chat import build_tool_tokenizer
from trl_ppo.config_checks import validate_config
from trl_ppo.models import PolicyAndValueWrapper


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"agent_rollout": "lockstep"}, "agent_rollout='continuous'"),
        ({"advantage_estimator": "gae", "num_generations": 1}, "a critic-free `advantage_estimator`"),
        ({"kl_penalty": "full"}, "`kl_penalty` other than 'full'"),
        ({"max_staleness": 1, "off_policy_correction": "tis"}, "`max_staleness=0`"),
        ({"off_policy_correction": "tis"}, "no `off_policy_correction`"),
    ],
)
def test_what_the_option_cannot_work_with_is_refused_before_any_model(tmp_path, overrides, named):
    values = dict(output_dir=str(tmp_path), advantage_estimator="grpo", num_generations=2, use_sampler_logprobs=True)
    validate_config(PPOConfig(**values))  # critic-free, continuous: accepted
    with pytest.raises(ValueError, match="use_sampler_logprobs=True` needs") as refused:
        validate_config(PPOConfig(**values | overrides))
    assert named in str(refused.value)


def test_one_turn_runs_are_told_they_have_no_sampler_logprobs(make_config, tokenizer, load_models, prompt_dataset):
    args = make_config(advantage_estimator="grpo", num_generations=2, use_sampler_logprobs=True)
    with pytest.raises(ValueError, match="one-turn sampling records none"):
        build_trainer(args, tokenizer, load_models, prompt_dataset, reward=lambda completions, **kw: [0.0],
                      value_model=None)  # fmt: skip


@pytest.fixture
def no_grad_calls(monkeypatch) -> list:
    """A list that gains an item at each no-grad forward of the policy (and its value head)."""
    forward, calls = PolicyAndValueWrapper.forward, []

    def counted(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            calls.append(1)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(PolicyAndValueWrapper, "forward", counted)
    return calls


@pytest.mark.slow  # two whole runs: `make test` has them, the quick loop does not
@needs_tool_parsing
def test_the_sampler_logprobs_skip_the_policy_forward_and_train_the_same(make_config, no_grad_calls):
    tokenizer = build_tool_tokenizer()
    runs = {}
    for use in (False, True):
        no_grad_calls.clear()
        trainer = agent_trainer(make_config, tokenizer, lambda completions, **kw: [len(c) % 3 for c in completions],
                                response_length=64, advantage_estimator="grpo", num_generations=2,
                                use_sampler_logprobs=use)  # fmt: skip
        trainer.train()
        updates = [entry for entry in trainer.state.log_history if "loss/policy_avg" in entry]
        weights = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        runs[use] = (len(no_grad_calls), updates, weights)
    (calls_forward, logs_forward, weights_forward), (calls_sampler, logs_sampler, weights_sampler) = runs.values()
    assert len(logs_forward) == len(logs_sampler) == 2
    assert calls_forward == 2 and calls_sampler == 0  # one chunk of 2 episodes per update, or none
    assert all("rollout/logprob_diff_mean" in entry for entry in logs_forward)
    assert not any("rollout/logprob_diff_mean" in entry for entry in logs_sampler)  # nothing left to compare
    for a, b in zip(logs_forward, logs_sampler):  # the same episodes, and the same update to rounding
        assert a["objective/scores"] == b["objective/scores"]
        assert a["val/mean_response_length"] == b["val/mean_response_length"]
        assert a["loss/policy_avg"] == pytest.approx(b["loss/policy_avg"], abs=1e-5)
        assert a["objective/kl"] == pytest.approx(b["objective/kl"], abs=1e-4)
    assert any(entry["objective/frac_reward_zero_std"] < 1 for entry in logs_forward)  # a group had a signal
    assert torch.allclose(weights_forward, weights_sampler, atol=1e-5)


@needs_tool_parsing
@pytest.mark.parametrize("engine", [True, False])
def test_the_asynchronous_sampler_skips_the_policy_forward_where_the_engine_recorded_it(make_config, no_grad_calls,
                                                                                        engine):
    """The sampler process's rollout (`_sample_ahead`, called here in this process) needs the behaviour policy's
    log-probs and the reference's: where the episode engine recorded the former, the policy's no-grad forward (and
    its value head's) is not run, as the trainer recomputes both; the lockstep loop records none, so the forward
    gives them."""
    tokenizer = build_tool_tokenizer()
    trainer = agent_trainer(make_config, tokenizer, lambda completions, **kw: [0.0] * len(completions),
                            response_length=32, max_staleness=1, off_policy_correction="tis",
                            agent_rollout="continuous" if engine else "lockstep")  # fmt: skip
    rollout = trainer._sample_ahead(1, next(iter(trainer.train_dataloader)))
    assert len(no_grad_calls) == (0 if engine else 1)
    assert rollout.values is None and rollout.ref_logprobs is not None
    assert rollout.sampler_logprobs is not None and torch.equal(rollout.logprobs, rollout.sampler_logprobs)
    mask = rollout.response_mask
    assert torch.isfinite(rollout.ref_logprobs[mask]).all() and (rollout.ref_logprobs[mask] <= 0).all()

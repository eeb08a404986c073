"""Asynchronous runs on the vLLM engine (issue 67): the sampler process of `max_staleness` makes an engine of its
own and pushes it each version of the weights it loads. Apart from tests/test_vllm_backend.py, and run by
`make test-vllm` in a pytest process of its own: the sampler is forked from the test process, which must not have
made a vLLM engine itself (an inherited engine's state hangs the child; the trainer refuses it)."""

import os

import pytest
from conftest import needs_tool_parsing
from test_vllm_backend import agent_engine_trainer, needs_vllm, trained_agent_logs, update_logs, vllm_trainer

STALE = dict(max_staleness=1, off_policy_correction="decoupled")


@needs_vllm
def test_an_asynchronous_run_samples_on_an_engine_of_the_sampler_and_resumes_exactly(
    make_config, tokenizer, load_models, prompt_dataset, tmp_path, monkeypatch
):
    """`max_staleness=1`: the sampler process makes its own engine and pushes it the version of the weights it
    loaded; the updates see staleness 1 from the second batch on, the engine's log-probs are the behaviour
    policy's (against the proximal: `rollout/logprob_diff_*`), and a run resumed from a stale checkpoint trains
    the updates after it as the uninterrupted run did."""
    from trl_ppo.rollout.vllm_engine import VLLMEngine

    pushes, push = tmp_path / "pushes.txt", VLLMEngine.push

    def logged_push(engine, policy, version):  # the forked sampler inherits it; a file outlives the process
        with open(pushes, "a") as log:
            log.write(f"{os.getpid()} {version}\n")
        push(engine, policy, version)

    monkeypatch.setattr(VLLMEngine, "push", logged_push)
    settings = STALE | dict(total_episodes=32, save_strategy="steps", save_steps=2, output_dir=str(tmp_path / "run"))
    trainer = vllm_trainer(make_config, tokenizer, load_models, prompt_dataset, **settings)
    trainer.train()
    logs = update_logs(trainer)
    pushed = [line.split() for line in pushes.read_text().splitlines()]
    assert [version for _, version in pushed] == ["0", "1", "2"]  # batches 1-4 sampled by versions 0, 0, 1, 2
    assert {pid for pid, _ in pushed} != {str(os.getpid())} and len({pid for pid, _ in pushed}) == 1
    assert [entry["offpolicy/staleness"] for entry in logs] == [0.0, 1.0, 1.0, 1.0]
    assert trainer._vllm_engine is None  # the trainer's process sampled nothing: the sampler's engine did
    assert all(entry["rollout/logprob_diff_mean"] > 0 for entry in logs[1:])  # behaviour is one update older
    resumed = vllm_trainer(make_config, tokenizer, load_models, prompt_dataset, **settings)
    resumed.train(resume_from_checkpoint=f"{settings['output_dir']}/checkpoint-2")
    for before, again in zip(logs[2:], update_logs(resumed)[2:], strict=True):
        for name in ("objective/scores", "objective/kl", "loss/policy_avg", "val/ratio", "offpolicy/staleness"):
            assert again[name] == pytest.approx(before[name], abs=1e-6), name


@needs_vllm
@needs_tool_parsing
def test_agents_sampled_ahead_play_on_the_samplers_engine(make_config):
    trainer = agent_engine_trainer(make_config, **STALE)
    logged = trained_agent_logs(trainer)
    assert trainer._vllm_engine is None and logged[1]["offpolicy/staleness"] == 1.0  # the sampler's engine played
    assert logged[1]["rollout/logprob_diff_mean"] > 1e-4  # behaviour (version 0) against proximal (version 1)

"""Asynchronous PPO (issue 55): `max_staleness` >= 1 samples in a process of its own, a fixed number of updates
behind, with a named off-policy correction; the refusals, the schedule, repeatability and an exact resume."""

import json

import pytest
import torch
from conftest import load_example_script, needs_tool_parsing
from test_resume import logs_without_time, make, weights
from transformers import TrainerCallback

from trl_ppo.config_checks import validate_config
from trl_ppo.rollout.asynchronous import sampling_version

ASYNC = dict(max_staleness=1, off_policy_correction="decoupled", save_strategy="no")


def test_sampling_schedule_is_exactly_k_behind():
    assert [sampling_version(batch, 1) for batch in range(1, 6)] == [0, 0, 1, 2, 3]
    assert [sampling_version(batch, 2) for batch in range(1, 6)] == [0, 0, 0, 1, 2]
    # a sampler started at version 2 (a resume): nothing older than the weights it has
    assert [sampling_version(batch, 2, first_version=2) for batch in range(3, 8)] == [2, 2, 2, 3, 4]


def test_stale_run_without_a_named_correction_is_refused(make_config, tokenizer, load_models, prompt_dataset):
    """By the trainer, before any model is touched (`validate_config`)."""
    with pytest.raises(ValueError, match="Set `off_policy_correction` to 'decoupled'"):
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


@pytest.mark.parametrize("correction", ["decoupled", pytest.param("tis", marks=pytest.mark.slow),
                                        pytest.param("none", marks=pytest.mark.slow)])  # fmt: skip
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


@pytest.mark.slow  # a full run or two: `make test` runs it, the quick loop does not
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


@pytest.mark.parametrize("staleness", [1, 3])
def test_a_failing_reward_in_the_sampler_stops_the_run_with_its_traceback(staleness, make_config, tokenizer,
                                                                          load_models, prompt_dataset):  # fmt: skip
    """Also when batches sampled before the failure are still unread (k=3: the trainer is waiting to publish)."""
    calls = []

    def reward(prompts, completions, **columns):
        calls.append(1)
        if len(calls) > 2:  # the sampler process's third batch
            raise KeyError("the judge is down")
        return [0.0] * len(completions)

    settings = dict(ASYNC, max_staleness=staleness)
    trainer = make(make_config, tokenizer, load_models, prompt_dataset, rewards=reward, **settings)
    with pytest.raises(RuntimeError, match="(?s)sampler process failed on batch 3.*the judge is down"):
        trainer.train()


@pytest.mark.slow  # a full run or two: `make test` runs it, the quick loop does not
def test_calls_into_user_code_that_timed_out_in_the_sampler_are_counted(make_config, tokenizer, load_models,
                                                                        prompt_dataset):  # fmt: skip
    import time

    calls = []

    def reward(prompts, completions, **columns):
        calls.append(1)
        if len(calls) == 2:  # the first try of the second batch passes its deadline
            time.sleep(2)
        return [0.0] * len(completions)

    settings = dict(ASYNC, reward_timeout=0.5, user_call_retries=1, user_call_backoff=0.0, logging_steps=1)
    trainer = make(make_config, tokenizer, load_models, prompt_dataset, rewards=reward, **settings)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "calls/timeouts" in entry]
    assert sum(entry["calls/timeouts"] for entry in logged) == 1
    assert sum(entry["calls/retries"] for entry in logged) == 1


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def tiny_agent_trainer(make_config, callbacks=None, rewards=(), **overrides):
    """Multi-turn episodes with an environment (the credit benchmark's chain_2) for a random tiny Qwen2 policy,
    critic-free (GRPO over groups of 4), sampled `max_staleness=1` ahead unless `overrides` say otherwise."""
    import sys

    from conftest import REPO_ROOT
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Qwen2Config

    from trl_ppo import PPOTrainer

    sys.path[:0] = [f"{REPO_ROOT}/benchmark/{folder}" for folder in ("credit", "agents", "learning")]
    import tasks

    tokenizer = tasks.build_tokenizer()
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None))  # fmt: skip
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": tasks.PROMPT}]] * 32, "seed": list(range(32))})
    settings = dict(max_turns=3, response_length=48, stop_token="eos", total_episodes=24, per_device_train_batch_size=8,
                    gradient_accumulation_steps=1, advantage_estimator="grpo", num_generations=4,
                    local_rollout_forward_batch_size=8, **ASYNC)  # fmt: skip
    config = make_config(**(settings | overrides))
    return PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=None, reward_model=list(rewards),
                      train_dataset=data, environment_factory=tasks.TASKS["chain_2"], callbacks=callbacks)  # fmt: skip


@needs_tool_parsing
def test_agents_sample_ahead_too(make_config, tmp_path):
    """Multi-turn episodes with an environment (a random tiny policy) played in the sampler process: the
    environment's reward and the `env/` metrics reach the trainer, one update behind."""
    trainer = tiny_agent_trainer(make_config)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "offpolicy/staleness" in entry]
    assert [entry["offpolicy/staleness"] for entry in logs] == [0, 1, 1]
    assert all(entry["env/turns_mean"] >= 1 for entry in logs)
    assert all("objective/scores/environment" in entry for entry in logs)


@pytest.mark.slow  # a full run or two: `make test` runs it, the quick loop does not
def test_a_signal_checkpoints_what_is_in_flight_and_the_resumed_run_ends_as_the_straight_one(
    make_config, tokenizer, load_models, prompt_dataset, tmp_path
):
    """SIGINT during update 3's scoring: the update is finished (the sampler's batches cannot be sampled again),
    checkpoint-3 holds the batches sampled ahead, the process exits 0; the resumed run ends where a straight one
    does, bit for bit."""
    import os
    import signal

    settings = dict(ASYNC, max_staleness=2, save_strategy="steps", save_steps=100)
    straight = make(make_config, tokenizer, load_models, prompt_dataset, output_dir=str(tmp_path / "a"), **settings)
    straight.train()
    output_dir = str(tmp_path / "b")
    trainer = make(make_config, tokenizer, load_models, prompt_dataset, output_dir=output_dir, **settings)
    original = trainer.compute_rewards

    def compute_rewards(rollout):
        if trainer.state.global_step == 2:  # update 3 has its episodes, not yet its update
            os.kill(os.getpid(), signal.SIGINT)
        return original(rollout)

    trainer.compute_rewards = compute_rewards
    with pytest.raises(SystemExit) as stopped:
        trainer.train()
    assert stopped.value.code == 0
    assert sorted(path.name for path in (tmp_path / "b").glob("checkpoint-*")) == ["checkpoint-3"]
    resumed = make(make_config, tokenizer, load_models, prompt_dataset, output_dir=output_dir, **settings)
    resumed.train(resume_from_checkpoint=True)
    assert logs_without_time(resumed) == logs_without_time(straight)
    for name, tensor in weights(straight).items():
        assert torch.equal(tensor, weights(resumed)[name]), name


@pytest.mark.slow  # a full run or two: `make test` runs it, the quick loop does not
def test_an_async_reward_function_runs_in_the_sampler_process(make_config, tokenizer, load_models, prompt_dataset):
    """The run's event loop (a daemon thread) does not survive the fork: the sampler starts its own."""
    import asyncio

    from trl_ppo import async_loop

    async def reward(prompts, completions, **columns):
        await asyncio.sleep(0)
        return [float(len(c.split())) for c in completions]

    async_loop.run(asyncio.sleep(0))  # the trainer's loop is running before the fork
    trainer = make(make_config, tokenizer, load_models, prompt_dataset, rewards=reward, **ASYNC)
    trainer.train()
    assert all("objective/scores" in entry for entry in trainer.state.log_history[:-1])


def test_a_batch_is_scored_on_the_main_thread_while_the_next_one_samples(make_config, tokenizer, load_models,
                                                                         prompt_dataset, tmp_path):  # fmt: skip
    """A plain reward function runs on the sampler process's main thread (as it would without `max_staleness`), and
    the next batch samples meanwhile: the policy's forwards go on while the first batch's scoring waits for them.
    Batches still arrive in order (the logged staleness follows the schedule)."""
    import json
    import threading
    import time

    forwards, record = [], tmp_path / "scoring.jsonl"

    def reward(prompts, completions, **columns):
        seen, deadline = len(forwards), time.monotonic() + 20
        while len(forwards) == seen and time.monotonic() < deadline and not record.exists():  # the first call waits
            time.sleep(0.01)
        with open(record, "a") as handle:  # this runs in the sampler process: the test reads the file
            on_main = threading.current_thread() is threading.main_thread()
            handle.write(json.dumps({"on_main": on_main, "sampled_meanwhile": len(forwards) > seen}) + "\n")
        return [0.0] * len(completions)

    trainer = make(make_config, tokenizer, load_models, prompt_dataset, rewards=reward, logging_steps=1, **ASYNC)
    trainer._models().wrapper.lm.register_forward_pre_hook(lambda module, inputs: forwards.append(1))
    trainer.train()
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert all(call["on_main"] for call in calls)
    assert calls[0]["sampled_meanwhile"]  # batch 2 sampled while batch 1 was scored
    logs = [entry for entry in trainer.state.log_history if "offpolicy/staleness" in entry]
    assert [entry["offpolicy/staleness"] for entry in logs] == [0, 1, 1, 1, 1, 1]


def test_async_reward_functions_score_batches_at_once(make_config, tokenizer, load_models, prompt_dataset,
                                                      tmp_path):  # fmt: skip
    """`async` rewards (an HTTP judge): the sampler scores up to `max_staleness` + 1 batches at once, their calls
    overlapping on the event loop; the run's numbers are those of the same run with a plain reward function."""
    import asyncio

    record = tmp_path / "concurrency.txt"
    running = []

    def judged(completions):
        return [float(c.split().count("good")) - 0.1 * len(c.split()) for c in completions]

    async def judge(prompts, completions, **columns):
        running.append(1)
        with open(record, "a") as handle:
            handle.write(f"{len(running)}\n")
        await asyncio.sleep(0.2)
        running.pop()
        return judged(completions)

    def plain(prompts, completions, **columns):
        return judged(completions)

    runs = []
    for reward in (judge, plain):
        trainer = make(make_config, tokenizer, load_models, prompt_dataset, rewards=reward,
                       output_dir=str(tmp_path / reward.__name__), logging_steps=1, **ASYNC)  # fmt: skip
        assert trainer._sampler_scorers() == (2 if reward is judge else 1)
        trainer.train()
        runs.append(trainer)
    assert max(int(line) for line in record.read_text().split()) == 2
    def renamed(run, name):
        return [{key.replace(f"/{name}", "/reward"): value for key, value in e.items()} for e in logs_without_time(run)]

    assert renamed(runs[0], "judge") == renamed(runs[1], "plain")


def test_the_sampler_skips_the_value_model(make_config, tokenizer, load_models, prompt_dataset):
    """Its values would be a stale critic's: the sampler's pass leaves them to the trainer (no value-model forward)
    and its log-probs are those of the full pass."""
    trainer = make(make_config, tokenizer, load_models, prompt_dataset, **ASYNC)
    batch = next(iter(trainer.train_dataloader))
    calls = []
    trainer._models().wrapper.value_model.score.register_forward_pre_hook(lambda module, inputs: calls.append(1))
    torch.manual_seed(0)
    sampled = trainer._sample_ahead(1, dict(batch))
    assert sampled.values is None and not calls
    torch.manual_seed(0)
    full = trainer.collect_rollout(dict(batch))
    assert calls and full.values is not None
    assert torch.equal(sampled.sampler_logprobs, full.logprobs) and torch.equal(sampled.ref_logprobs, full.ref_logprobs)


@pytest.mark.slow  # a full run each: `make test` runs it, the quick loop does not
@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_baseline"])
def test_every_advantage_estimator_trains_asynchronously(estimator, make_config, tokenizer, load_models,
                                                         prompt_dataset):  # fmt: skip
    """The critic-free estimators too (GAE is every other test's): groups of `num_generations` stay whole in the
    batches sampled ahead, the schedule holds and the losses are finite; no values are computed anywhere."""
    settings = dict(ASYNC, advantage_estimator=estimator, num_generations=4, logging_steps=1)
    trainer = make(make_config, tokenizer, load_models, prompt_dataset, **settings)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "offpolicy/staleness" in entry]
    assert [entry["offpolicy/staleness"] for entry in logs] == [0, 1, 1, 1, 1, 1]
    assert all(torch.isfinite(torch.tensor(entry["loss/policy_avg"])) for entry in logs)
    assert all("loss/value_avg" not in entry for entry in logs)


def test_the_tool_task_report_compares_each_cell_with_the_synchronous_one(tmp_path):
    """benchmark/asynchronous/report.py --tool on hand-made rows: 128 episodes in 1000 s and 640 s are 0.128 and
    0.200 episodes/s, 1.56x; the held-out spread and the critic's late explained variance (a row without it is
    left out of that column)."""
    report = load_example_script("report", "benchmark/asynchronous")
    summary = {"success": 0.0}

    def row(staleness, correction, wall, after, explained=None):
        return {"max_staleness": staleness, "off_policy_correction": correction, "updates": 16, "batch_size": 8,
                "train_wall_seconds": wall, "train_cpu_seconds": 1000.0, "before": summary,
                "after": {"success": after}, "training_success": [0.0, 0.5, 0.5, 1.0, 1.0],
                **({"explained_variance": {"all": explained}} if explained else {})}

    rows = [row(1, "tis", 640.0, 0.0, [0.9, 0.1, 0.2, None, 0.3]), row(0, None, 1000.0, 1.0),
            row(1, "tis", 640.0, 1.0)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = report.tool_table(report.tool_cells(str(path))).splitlines()
    assert lines[2] == ("| 0 | - | 1 | 0.128 | 1.00 | 1000 | 0.75 [0.75, 0.75] | 0.00 [0.00, 0.00] "
                        "| 1.00 [1.00, 1.00] | - |")
    assert lines[3] == ("| 1 | tis | 2 | 0.200 | 1.56 | 1000 | 0.75 [0.75, 0.75] | 0.00 [0.00, 0.00] "
                        "| 0.50 [0.00, 1.00] | 0.200 [0.200, 0.200] (1 seeds) |")

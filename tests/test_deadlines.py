"""A deadline on every call into user code (issue 46, part 1): a reward function (sync or async), an environment's
`reset`, `get_reward` or `close`, or a tool that never returns is stopped at its deadline with the documented
outcome: reward functions, `get_reward` and `reset` are retried, then stop the run naming the function, the update
not applied and the last checkpoint intact; `close` and tools go on with a warning or an error answer."""

import asyncio
import logging
import threading
import time

import pytest
from conftest import build_trainer, needs_tool_parsing
from test_agent_environments import grpo_trainer

from trl_ppo import PPOConfig
from trl_ppo.agents import execution
from trl_ppo.agents import runner as agent_runner_module
from trl_ppo.agents.environments import Environments, close_environments, environment_reward
from trl_ppo.agents.execution import ToolCall, execute_calls
from trl_ppo.agents.tiny_chat import build_tool_tokenizer
from trl_ppo.agents.tools import toolbox
from trl_ppo.checkpoint.folders import checkpoint_folders
from trl_ppo.checkpoint.manifest import checkpoint_problem
from trl_ppo.deadlines import Deadlines, UserCallError, is_transient, take_counts
from trl_ppo.reward_functions import reward_function_scores

QUICK = Deadlines(reward=0.2, environment=0.2, retries=1, backoff=0.01)


@pytest.fixture
def release():
    """An event that hung calls wait on: set at the end of the test, so that their threads end."""
    event = threading.Event()
    yield event
    event.set()


def test_the_defaults_are_finite_and_none_lifts_a_deadline():
    config = PPOConfig(output_dir="unused", report_to="none")
    assert (config.tool_timeout, config.environment_timeout, config.reward_timeout) == (300.0, 300.0, 300.0)
    assert config.user_call_retries == 2
    lifted = PPOConfig(output_dir="unused", report_to="none", reward_timeout=None, environment_timeout=None)
    assert Deadlines.from_config(lifted).reward is None


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(reward_timeout=-1.0), r"`reward_timeout` must be a finite number of seconds > 0 \(or None"),
        (dict(environment_timeout=float("inf")), "`environment_timeout` must be a finite number of seconds > 0"),
        (dict(user_call_retries=-1), "`user_call_retries` must be >= 0"),
        (dict(user_call_backoff=-0.5), "`user_call_backoff` must be >= 0"),
    ],
)
def test_bad_deadlines_are_refused_when_the_config_is_made(settings, message):
    with pytest.raises(ValueError, match=message):
        PPOConfig(output_dir="unused", report_to="none", **settings)


def test_a_reward_function_that_times_out_is_retried_then_stops_the_run_keeping_the_checkpoint(
    make_config, tokenizer, load_models, prompt_dataset, release, caplog
):
    """Update 1: the first call hangs, the retry answers (counted). Update 2: every try hangs: the run stops
    before the update, naming the function; checkpoint-1 is intact."""
    calls = []

    def judge(prompts, completions, **columns):
        calls.append(len(calls))
        if len(calls) != 2:  # the 2nd call (update 1's retry) answers; every other one hangs
            release.wait()
        return [1.0] * len(completions)

    settings = dict(reward_timeout=0.2, user_call_retries=1, user_call_backoff=0.01, save_strategy="steps",
                    save_steps=1)
    trainer = build_trainer(make_config(**settings), tokenizer, load_models, prompt_dataset, reward=judge)
    start = time.perf_counter()
    with caplog.at_level(logging.WARNING), pytest.raises(UserCallError) as raised:
        trainer.train()
    assert time.perf_counter() - start < 30
    message = str(raised.value)
    assert message.startswith("Update 2: Reward function 'judge' did not return within 0.2 s on each of its 2 tries")
    assert "the run stops" in message and "`reward_timeout`" in message and "resume from it" in message
    assert "Reward function 'judge' did not return within 0.2 s; trying again in 0.01 s (try 2 of 2)" in caplog.text
    assert trainer.state.global_step == 1 and len(calls) == 4
    logged = next(entry for entry in trainer.state.log_history if "objective/kl" in entry)
    assert (logged["calls/timeouts"], logged["calls/retries"]) == (1, 1)
    [checkpoint] = checkpoint_folders(trainer.args.output_dir)
    assert checkpoint.endswith("checkpoint-1") and checkpoint_problem(checkpoint) is None


def test_an_async_reward_function_is_cancelled_at_its_deadline():
    cancelled = []

    async def slow_judge(prompts, completions):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    once = Deadlines(reward=0.2, retries=0)
    with pytest.raises(UserCallError, match="Reward function 'slow_judge' did not return within 0.2 s on its only"):
        reward_function_scores(slow_judge, "slow_judge", ["p"] * 2, ["c"] * 2, {}, "cpu", once)
    time.sleep(0.05)
    assert cancelled == [True]


def test_transient_errors_are_retried_and_others_are_not():
    failures = [ConnectionError("reset by peer"), type("ReadTimeout", (OSError,), {})("slow")]

    def flaky(prompts, completions):
        if failures:
            raise failures.pop(0)
        return [0.5] * len(completions)

    take_counts()
    scores, _ = reward_function_scores(flaky, "flaky", ["p"], ["c"], {}, "cpu", Deadlines(reward=1.0, retries=2,
                                                                                          backoff=0.01))
    assert scores.tolist() == [0.5] and take_counts() == (0, 2)

    tries = []

    def buggy(prompts, completions):
        tries.append(1)
        raise KeyError("a bug")

    with pytest.raises(KeyError, match="a bug"):
        reward_function_scores(buggy, "buggy", ["p"], ["c"], {}, "cpu", QUICK)
    assert len(tries) == 1  # a bug is not retried

    def always_down(prompts, completions):
        raise ConnectionRefusedError("judge is down")

    with pytest.raises(UserCallError, match="Reward function 'always_down' raised ConnectionRefusedError: judge is"
                                            r" down on each of its 2 tries \(0.01 s apart\)") as raised:
        reward_function_scores(always_down, "always_down", ["p"], ["c"], {}, "cpu", QUICK)
    assert isinstance(raised.value.__cause__, ConnectionRefusedError)


@pytest.mark.parametrize(
    "name, transient",
    [("ReadTimeout", True), ("APIConnectionError", True), ("RateLimitError", True), ("NetworkError", True),
     ("NetworkXError", False), ("ValueError", False), ("TimeoutTooShortWarning", False)],
)
def test_transient_errors_are_known_by_their_class_names(name, transient):
    assert is_transient(type(name, (Exception,), {})()) is transient


class Hangs:
    """An environment whose methods hang (until released) where asked."""

    made = 0
    release: threading.Event

    def __init__(self):
        Hangs.made += 1

    def reset(self, hang=False, **row):
        if hang:
            Hangs.release.wait()

    def get_reward(self):
        Hangs.release.wait()
        return 1.0

    def close(self):
        Hangs.release.wait()


def test_an_environment_that_hangs_is_retried_on_a_new_instance_then_named(release):
    Hangs.release, Hangs.made = release, 0
    environments = Environments(Hangs, deadlines=QUICK)
    environment, _ = environments.create({"hang": False})
    with pytest.raises(UserCallError, match=r"`Hangs.reset` did not return within 0.2 s on each of its 2 tries.*"
                                            "`environment_timeout`"):
        environments.create({"hang": True})
    assert Hangs.made == 3  # one per try: the abandoned one may still be running
    with pytest.raises(UserCallError, match="`Hangs.get_reward` did not return within 0.2 s on each of its 2 tries"):
        environment_reward(environment, QUICK)


def test_closes_that_hang_are_stopped_side_by_side_under_one_deadline(release, caplog):
    Hangs.release = release
    take_counts()
    start = time.perf_counter()
    with caplog.at_level(logging.WARNING):
        close_environments([Hangs(), Hangs(), Hangs()], 0.3)
    assert time.perf_counter() - start < 0.8  # one deadline for the batch, not one per environment
    assert caplog.text.count("`Hangs.close()` did not return within 0.3 s (stopped") == 3
    assert take_counts() == (3, 0)


def test_an_async_tool_that_blocks_the_event_loop_is_given_up(monkeypatch):
    """An `async` tool that never awaits holds the run's loop, so its own deadline cannot fire there: the caller
    gives its calls up, as timed out, after the loop's grace."""
    monkeypatch.setattr(execution, "LOOP_GRACE", 0.2)

    async def blocks(x: int) -> str:
        """Block the loop.

        Args:
            x: anything.
        """
        time.sleep(1.0)  # not `await asyncio.sleep`: the loop is held (briefly, so later tests find it free)
        return "late"

    start = time.perf_counter()
    [[answer]] = execute_calls([[ToolCall("blocks", {"x": 1})]], [toolbox([blocks])], timeout=0.1)
    assert time.perf_counter() - start < 0.9
    assert answer.timed_out and "did not answer within 0.1 s" in answer.content
    time.sleep(0.8)  # the loop is free again


@needs_tool_parsing
def test_a_get_reward_that_hangs_in_training_is_retried_then_stops_the_run(make_config, monkeypatch, release):
    tokenizer = build_tool_tokenizer()
    tokenizer.response_template = None  # no tools: one turn per episode
    tries = []

    class SlowQuiz:
        def reset(self, **kwargs) -> str:
            return "Reply in one word."

        def get_reward(self) -> float:
            tries.append(1)
            if len(tries) == 1 or len(tries) >= 4:  # update 1: its first call hangs, once; update 2: every call
                release.wait()
            return 1.0

    def answers(models, sampling):
        answer = tokenizer.encode("Yes.<|im_end|>", add_special_tokens=False)
        return lambda contexts, max_new_tokens: [answer] * len(contexts)

    monkeypatch.setattr(agent_runner_module, "turn_sampler", answers)
    monkeypatch.setattr(agent_runner_module.AgentRunner, "_lockstep", True)  # the script is the lockstep loop's sampler
    settings = dict(max_turns=1, environment_timeout=0.2, user_call_retries=1, user_call_backoff=0.01)
    trainer = grpo_trainer(make_config, tokenizer, [], SlowQuiz, **settings)
    with pytest.raises(UserCallError, match=r"Update 2: `SlowQuiz.get_reward` did not return within 0.2 s on each of "
                                            "its 2 tries"):
        trainer.train()
    [logged] = [entry for entry in trainer.state.log_history if "env/turns_mean" in entry]
    assert logged["objective/scores/environment"] == 1.0
    assert (logged["calls/timeouts"], logged["calls/retries"]) == (1, 1)


# ------------------------------------------------------------ found by benchmark/reliability/probe.py (issue 46, part 5)
HANGING_TOOL_SCRIPT = '''
import threading
from trl_ppo.agents.execution import ToolCall, execute_calls
from trl_ppo.agents.tools import toolbox

def hangs(x: int) -> str:
    """Never return.

    Args:
        x: anything.
    """
    threading.Event().wait()

[[answer]] = execute_calls([[ToolCall("hangs", {"x": 1})]], [toolbox([hangs])], timeout=0.1)
print("answered", answer.timed_out)
'''


@pytest.mark.slow
def test_a_sync_tool_that_never_returns_does_not_keep_the_process_from_exiting():
    """The probe's `tool_hangs`: the run finished and saved its model, then never exited, because the tool pool's
    threads (`ThreadPoolExecutor`'s) are joined at interpreter exit."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", HANGING_TOOL_SCRIPT], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "answered True", done.stderr


@needs_tool_parsing
def test_an_environment_that_hangs_when_the_trainer_lists_its_tools_is_named(make_config, release):
    """The probe's `env_init_hangs`: the instance the trainer makes to list an environment's tools had no deadline,
    so a factory that never returned hung `PPOTrainer(...)` itself."""

    class NeverMade:
        def __init__(self):
            release.wait()

        def look(self, x: int) -> str:
            """Look.

            Args:
                x: anything.
            """
            return "nothing"

    settings = dict(environment_timeout=0.2, user_call_retries=1, user_call_backoff=0.01)
    start = time.perf_counter()
    with pytest.raises(UserCallError, match=r"`NeverMade\(\)` \(the instance made to list its tools\) did not return "
                                            "within 0.2 s on each of its 2 tries"):
        grpo_trainer(make_config, build_tool_tokenizer(), [], NeverMade, **settings)
    assert time.perf_counter() - start < 10


def test_a_reward_function_calling_sys_exit_is_named():
    """The probe's `reward_sys_exit`: `sys.exit(3)` in a reward function ended the run with status 3 and no
    message (and under several processes would leave the others waiting)."""

    def quits(prompts, completions):
        raise SystemExit(3)

    with pytest.raises(UserCallError, match=r"Reward function 'quits' raised SystemExit\(3\).*the run stops"):
        reward_function_scores(quits, "quits", ["p"], ["c"], {}, "cpu", QUICK)


def test_a_ctrl_c_during_a_reward_function_is_a_ctrl_c():
    """A sync reward function runs in the main thread, where a real Ctrl-C lands: it stops the run as
    `KeyboardInterrupt`, as it would without a deadline, not as the function's error."""

    def judge(prompts, completions):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        reward_function_scores(judge, "judge", ["p"], ["c"], {}, "cpu", QUICK)


@pytest.mark.parametrize("ending", [SystemExit(3), KeyboardInterrupt()])
def test_a_reward_function_ending_its_thread_off_the_main_thread_is_named(ending):
    """Off the main thread (a `train()` started in a thread of the user's) a reward function runs in a thread of its
    own, and what ends that thread is named, not lost."""
    outcome = []

    def quits(prompts, completions):
        raise ending

    def score():
        try:
            reward_function_scores(quits, "quits", ["p"], ["c"], {}, "cpu", QUICK)
        except UserCallError as error:
            outcome.append(str(error))

    caller = threading.Thread(target=score)
    caller.start()
    caller.join(10)
    assert len(outcome) == 1 and f"Reward function 'quits' raised {type(ending).__name__}" in outcome[0]


def test_trl_ppo_names_a_reward_function_that_never_answers_in_one_line(tmp_path):
    """The probe's `reward_hangs` / `reward_connection_error` under `trl-ppo`: a traceback of trl_ppo's own frames
    ended in the message; now the message alone, as `trl-ppo`'s other refusals."""
    from test_cli import SMALL_RUN

    from trl_ppo.cli import main

    (tmp_path / "judge.py").write_text("def down(prompts, completions, **_):\n    raise ConnectionError('no judge')\n")
    argv = ["--reward_function", f"{tmp_path}/judge.py:down", "--output_dir", str(tmp_path / "out"),
            "--user_call_retries", "0", *SMALL_RUN, "--num_sample_generations", "0"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    message = str(exit_.value.code)
    assert message.startswith("trl-ppo: Update 1: Reward function 'down' raised ConnectionError: no judge on its "
                              "only try"), message


SIGNAL_AFTER_SAVE_SCRIPT = '''
import os, signal, sys
from trl_ppo import trainer as trainer_module
from trl_ppo.cli import main

saved = trainer_module.PPOTrainer.save_model

def save_then_signal(self, *args, **kwargs):
    saved(self, *args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)  # a SIGTERM right after the final save, before the completions table

trainer_module.PPOTrainer.save_model = save_then_signal
main(sys.argv[1:])
'''


@pytest.mark.slow
def test_trl_ppo_exits_zero_on_a_sigterm_between_the_final_save_and_the_table(tmp_path):
    """The probe's `sigterm_in_final_table`: a SIGTERM landing after the save, before the table's handler, ended
    `trl-ppo` with status 143 (the default handler) once in two runs."""
    import subprocess
    import sys

    from test_cli import SMALL_RUN

    argv = ["--output_dir", str(tmp_path / "out"), *SMALL_RUN]
    done = subprocess.run([sys.executable, "-c", SIGNAL_AFTER_SAVE_SCRIPT, *argv], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "out" / "model.safetensors").is_file()

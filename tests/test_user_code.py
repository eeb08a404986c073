"""User code runs where it works, and a hung call is stopped (issue 53, part 1).

Sync reward functions run in the main thread under the default deadlines, so `signal.alarm` (math_verify's own
timeout) works in them; a call past its deadline is interrupted there, not left running beside its retry. Sync tools
run in threads of their own, and a hung one neither keeps its place nor keeps running Python code."""

import signal
import threading
import time

import pytest
from conftest import build_trainer

from trl_ppo import PPOConfig
from trl_ppo.agents import execution
from trl_ppo.agents.execution import ToolCall, execute_calls
from trl_ppo.agents.tools import toolbox
from trl_ppo.deadlines import Deadlines, UserCallError
from trl_ppo.reward_functions import reward_function_scores

DEFAULTS = Deadlines.from_config(PPOConfig(output_dir="unused", report_to="none"))


def math_reward(prompts, completions, answer, **columns):
    """The usual math reward: math_verify's `parse` (bounded by its own `signal.alarm`) and `verify`."""
    from math_verify import parse, verify

    return [float(verify(parse(gold), parse(completion))) for gold, completion in zip(answer, completions)]


def alarmed_reward(prompts, completions, **columns):
    """A reward that bounds its own work with SIGALRM, as verifiers do."""

    def too_slow(signum, frame):
        raise TimeoutError("scoring took more than 5 s")

    previous = signal.signal(signal.SIGALRM, too_slow)
    signal.alarm(5)
    try:
        return [len(completion.split()) / 10 for completion in completions]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_math_verify_scores_under_the_default_deadlines():
    assert DEFAULTS.reward == 300.0  # a deadline is on: the call is not simply made without one
    completions = ["The answer is $\\frac{1}{2}$.", "0.5", "It is 3."]
    scores, present = reward_function_scores(math_reward, "math_reward", ["p"] * 3, completions,
                                             {"answer": ["$0.5$"] * 3}, "cpu", DEFAULTS)  # fmt: skip
    assert scores.tolist() == [1.0, 1.0, 0.0] and present.all()


@pytest.mark.parametrize("reward", [math_reward, alarmed_reward])
def test_rewards_that_use_signal_train_under_the_defaults(reward, make_config, tokenizer, load_models, prompt_dataset):
    """Before: "doesn't support threaded environment" / "signal only works in main thread" at the first update."""
    dataset = prompt_dataset.add_column("answer", ["$1$"] * len(prompt_dataset))
    config = make_config()  # reward_timeout and user_call_retries at their defaults
    assert (config.reward_timeout, config.user_call_retries) == (300.0, 2)
    trainer = build_trainer(config, tokenizer, load_models, dataset, reward=reward)
    trainer.train()
    scores = [entry["objective/scores"] for entry in trainer.state.log_history if "objective/scores" in entry]
    assert trainer.state.global_step == 2 and len(scores) == 2
    if reward is alarmed_reward:  # its scores are real: tenths of the completions' word counts
        assert all(0 < score <= 0.6 for score in scores), scores


def test_a_hung_reward_function_is_stopped_before_its_retry():
    """Each try is interrupted at its deadline (its `finally` runs) before the next one starts: no try runs beside
    another, and none runs after the error. Before, every try spun on in a thread of its own."""
    events = []

    def spins(prompts, completions):
        events.append("start")
        try:
            while True:  # pure Python: a thread would have kept a core busy
                pass
        finally:
            events.append("stopped")

    deadlines = Deadlines(reward=0.2, retries=2, backoff=0.01)
    started = time.perf_counter()
    with pytest.raises(UserCallError, match="did not return within 0.2 s on each of its 3 tries"):
        reward_function_scores(spins, "spins", ["p"], ["c"], {}, "cpu", deadlines)
    assert time.perf_counter() - started < 3
    assert events == ["start", "stopped"] * 3
    time.sleep(0.3)
    assert events == ["start", "stopped"] * 3  # nothing of it still runs
    assert not [t for t in threading.enumerate() if t.name == "trl_ppo-deadline"]


def test_a_reward_function_asleep_in_c_is_interrupted():
    """A sleep (or a socket read) is a blocking C call: the signal interrupts it."""

    def sleeps(prompts, completions):
        time.sleep(3600)

    started = time.perf_counter()
    with pytest.raises(UserCallError, match="did not return within 0.3 s on its only try"):
        reward_function_scores(sleeps, "sleeps", ["p"], ["c"], {}, "cpu", Deadlines(reward=0.3, retries=0))
    assert time.perf_counter() - started < 2


def test_a_reward_function_that_catches_the_interrupt_gets_the_next_one():
    caught = []

    def stubborn(prompts, completions):
        try:
            time.sleep(3600)
        except BaseException:  # swallows the interrupt, as a broad `except` in user code may
            caught.append(True)
        time.sleep(3600)  # the interrupt sent again `RESEND` seconds later stops this
        return [1.0]

    started = time.perf_counter()
    with pytest.raises(UserCallError, match="did not return within 0.2 s"):
        reward_function_scores(stubborn, "stubborn", ["p"], ["c"], {}, "cpu", Deadlines(reward=0.2, retries=0))
    assert caught == [True] and time.perf_counter() - started < 2


def test_the_interrupt_signal_handler_is_put_back():
    from trl_ppo.interrupts import INTERRUPT_SIGNAL

    before = signal.getsignal(INTERRUPT_SIGNAL)
    reward_function_scores(lambda prompts, completions: [1.0], "quick", ["p"], ["c"], {}, "cpu", DEFAULTS)
    assert signal.getsignal(INTERRUPT_SIGNAL) is before


def hangs(x: int) -> str:
    """Wait forever, in C (a lock): no Python instruction runs, so it cannot be stopped, only left.

    Args:
        x: anything.
    """
    HANG.wait()
    return "released"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def spin(x: int) -> str:
    """Run Python code forever.

    Args:
        x: anything.
    """
    while True:
        pass


HANG = threading.Event()


@pytest.fixture
def release_hung_tools():
    HANG.clear()
    yield
    HANG.set()


def test_more_hung_tool_calls_than_places_do_not_slow_a_healthy_one(release_hung_tools):
    """Before: the hung calls held every thread of the pool (16), and the healthy call waited its whole timeout."""
    hung = execution.TOOL_WORKERS + 4
    answers = execute_calls([[ToolCall("hangs", {"x": i})] for i in range(hung)], [toolbox([hangs])] * hung, 0.3)
    assert all(answer.timed_out for [answer] in answers)
    started = time.perf_counter()
    [[answer]] = execute_calls([[ToolCall("add", {"a": 2, "b": 3})]], [toolbox([add])], timeout=5.0)
    assert answer.content == "5" and not answer.error
    assert time.perf_counter() - started < 0.5


def test_a_hung_tool_running_python_is_gone_after_its_deadline():
    """A call past `tool_timeout` is stopped in its thread (it was left spinning, a core kept busy until exit)."""
    [[answer]] = execute_calls([[ToolCall("spin", {"x": 1})]], [toolbox([spin])], timeout=0.2)
    assert answer.timed_out and "did not answer within 0.2 s; the call was stopped" in answer.content
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and [t for t in threading.enumerate() if t.name == "trl_ppo-tool-spin"]:
        time.sleep(0.02)
    assert not [t for t in threading.enumerate() if t.name == "trl_ppo-tool-spin"]


def test_deadlines_are_checked_against_ddp_timeout_in_a_run_of_several_processes():
    from trl_ppo.config_checks import check_deadlines_fit_process_group as check

    defaults = PPOConfig(output_dir="unused", report_to="none")
    check(defaults, environments=True, world_size=2)  # 3 x 300 s + 1 s + 2 s = 903 s < 1800 s
    old_default = PPOConfig(output_dir="unused", report_to="none", reward_timeout=600.0)
    check(old_default, environments=False, world_size=1)  # one process: no collective to wait in
    with pytest.raises(ValueError, match=r"`reward_timeout` with `user_call_retries` lets one call take 1803 s \(3 "
                                         r"tries of 600 s, and the backoff\), not less than `ddp_timeout` \(1800 s\)"):
        check(old_default, environments=False, world_size=2)
    slow_environments = PPOConfig(output_dir="unused", report_to="none", environment_timeout=1000.0)
    check(slow_environments, environments=False, world_size=2)  # no environments: their deadline bounds nothing
    with pytest.raises(ValueError, match="`environment_timeout` with `user_call_retries` lets one call take 3003 s"):
        check(slow_environments, environments=True, world_size=2)
    unbounded = PPOConfig(output_dir="unused", report_to="none", reward_timeout=None, ddp_timeout=60)
    check(unbounded, environments=False, world_size=2)  # None: no limit, the user's choice


POOL_REWARD = '''
import multiprocessing

def count_words(text):
    return len(text.split())

def probe(prompts, completions, **columns):
    with multiprocessing.get_context("fork").Pool(2) as pool:
        return [n / 10 for n in pool.map(count_words, completions)]
'''


def test_a_reward_files_helpers_can_be_sent_to_a_process_pool(tmp_path, monkeypatch):
    """The probe's `user_pool`: the file's module was not in `sys.modules`, so pickling its `count_words` for the
    pool's workers failed ("not the same object as reward.count_words")."""
    import sys

    from trl_ppo.script_args import load_reward_function

    (tmp_path / "pool_reward.py").write_text(POOL_REWARD)
    monkeypatch.delitem(sys.modules, "pool_reward", raising=False)
    probe = load_reward_function(f"{tmp_path}/pool_reward.py:probe")
    assert probe([], ["one two", "three"]) == [0.2, 0.1]
    assert sys.modules["pool_reward"].probe is probe


def test_a_process_forked_during_training_takes_sigterm_as_python_starts_it():
    """The probe's `user_pool_builtin`: a `Pool` worker forked by a reward inherited the trainer's SIGTERM handler
    (which only sets a flag), ignored `Pool.terminate()`, and the pool waited for it forever."""
    import os

    from trl_ppo.checkpoint.preemption import PreemptionHandler

    with PreemptionHandler():
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # the child: report its handler, then end at once
            os.write(write, b"default" if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL else b"trainer's")
            os._exit(0)
        os.close(write)
        reported = os.read(read, 64)
        os.waitpid(child, 0)
    assert reported == b"default"

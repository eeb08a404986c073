"""The environment runtime that TRL GRPO users rely on (issue 34, part 1), without a model: one event loop for the
run, async `reset` / `get_reward`, factories that are functions, `close()`, bound methods as tools, tool timeouts and
concurrent sync tools, answers cut by characters then tokens, unparseable markup, truncated episodes' math."""

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import needs_tool_parsing

from trl_ppo import ppo
from trl_ppo.agents import environments as agent_environments
from trl_ppo.agents.chat import ToolChat
from trl_ppo.agents.environments import Environments, environment_reward
from trl_ppo.agents.execution import ToolCall, execute_calls
from trl_ppo.agents.runner import AgentRunner
from trl_ppo.agents.tiny_chat import build_tool_tokenizer
from trl_ppo.agents.tools import schemas, toolbox
from trl_ppo.rollout.turn_loop import Episode, run_turns


class Ledger:
    """Async state made on the loop of its first use: a future created by the first call, awaited by the next."""

    def reset(self, **row):
        self.lock = asyncio.Lock()
        self.pending, self.closed = None, 0
        return f"Start at {row.get('start', 0)}."

    async def record(self, amount: int) -> str:
        """Record an amount.

        Args:
            amount: how much.
        """
        async with self.lock:
            if self.pending is None:  # first turn: a future bound to the running loop, resolved at the next
                self.pending, self.first = asyncio.get_running_loop().create_future(), amount
                return "first"
            asyncio.get_running_loop().call_later(0.01, self.pending.set_result, self.first)
            return f"total {await self.pending + amount}"  # "attached to a different loop" on a fresh loop

    async def get_reward(self) -> float:
        async with self.lock:
            return float(await self.pending)

    async def close(self) -> None:
        self.closed += 1


class AsyncLedger(Ledger):
    async def reset(self, **row):
        self.lock = asyncio.Lock()  # made on the run's loop, used by the tools
        self.pending, self.closed = None, 0
        self.loop = asyncio.get_running_loop()
        return f"Start at {row.get('start', 0)}."


def test_async_tool_state_survives_from_one_turn_to_the_next():
    ledger = Ledger()
    ledger.reset()
    tools = toolbox([], ledger)
    first = execute_calls([[ToolCall("record", {"amount": 2})]], [tools])
    second = execute_calls([[ToolCall("record", {"amount": 5})]], [tools])  # the next turn
    assert first[0][0].content == "first" and second[0][0].content == "total 7", second


def test_async_reset_get_reward_and_close_run_on_the_tools_loop():
    ledger, added = Environments(AsyncLedger).create({"start": 3})
    assert added == "Start at 3."  # an async `reset`, awaited
    for amount in (2, 5):
        answer = execute_calls([[ToolCall("record", {"amount": amount})]], [toolbox([], ledger)])[0][0]
    assert answer.content == "total 7" and ledger.pending.get_loop() is ledger.loop
    assert environment_reward(ledger) == 2.0  # an async `get_reward`, on the same loop
    agent_environments.close_environment(ledger)
    assert ledger.closed == 1


@needs_tool_parsing
def test_a_factory_function_and_its_environments_reward():
    args = SimpleNamespace(max_turns=3, max_tool_response_length=None)
    tokenizer = build_tool_tokenizer()
    runner = AgentRunner(args, tokenizer, None, lambda: Ledger(), tokenizer.eos_token_id, None)
    assert runner.environment_reward() is not None  # `get_reward` of what the function returns
    with pytest.raises(TypeError, match=r"`environment_factory` returned None.*must return the environment"):
        AgentRunner(args, tokenizer, None, lambda: None, tokenizer.eos_token_id, None)
    with pytest.raises(TypeError, match=r"`environment_factory\['b'\]` returned None"):
        Environments({"a": Ledger, "b": lambda: None}, ["environment"]).create({"environment": "b"})


@needs_tool_parsing
def test_the_probe_environment_is_closed():
    made = []

    class Probe(Ledger):
        def __init__(self):
            self.closed = 0
            made.append(self)

    tokenizer = build_tool_tokenizer()
    AgentRunner(SimpleNamespace(max_turns=2, max_tool_response_length=None), tokenizer, None, Probe,
                tokenizer.eos_token_id, None)
    assert [probe.closed for probe in made] == [1]


def test_an_environment_without_tools_needs_no_tool_call_parser():
    class Quiz:
        def reset(self, **row):
            return "Answer in one word."

        def get_reward(self) -> float:
            return 1.0

    tokenizer = build_tool_tokenizer()
    tokenizer.response_template = None  # nothing to parse
    args = SimpleNamespace(max_turns=1, max_tool_response_length=None)
    runner = AgentRunner(args, tokenizer, None, Quiz, tokenizer.eos_token_id, None)
    assert runner.chat is None and runner.environment_reward() is not None
    with pytest.raises(ValueError, match=r"`max_turns` is 3 but neither `tools` nor the environments' methods"):
        AgentRunner(SimpleNamespace(max_turns=3, max_tool_response_length=None), tokenizer, None, Quiz,
                    tokenizer.eos_token_id, None)


def test_only_bound_methods_are_tools():
    class Helper:
        def __call__(self, x: int) -> int:
            """Call.

            Args:
                x: x.
            """
            return x

    class Game:
        helper = Helper()  # a callable class attribute
        Board = dict  # a class

        def reset(self, **row):
            pass

        def move(self, direction: str) -> str:
            """Move.

            Args:
                direction: where.
            """
            return direction

        @staticmethod
        def rules(level: int) -> str:
            """The rules.

            Args:
                level: which.
            """
            return "none"

        @property
        def score(self) -> int:
            raise AssertionError("a property is not read when listing the tools")

        def close(self) -> None:
            pass

    assert sorted(toolbox([], Game())) == ["move"]


# -------------------------------------------------------------------------------------- timeouts, concurrency
def test_sync_tools_of_a_batch_run_concurrently():
    def wait(seconds: float) -> str:
        """Wait.

        Args:
            seconds: how long.
        """
        time.sleep(seconds)
        return "done"

    tools = toolbox([wait])
    start = time.perf_counter()
    results = execute_calls([[ToolCall("wait", {"seconds": 0.5})]] * 2, [tools, tools])
    elapsed = time.perf_counter() - start
    assert [r[0].content for r in results] == ["done", "done"]
    assert elapsed < 0.9, f"two episodes x a 0.5 s tool took {elapsed:.2f} s: run one after another"


def test_the_calls_of_one_episode_run_in_order():
    seen = []

    def note(word: str) -> str:
        """Note a word.

        Args:
            word: the word.
        """
        time.sleep(0.05 if word == "first" else 0.0)
        seen.append(word)
        return word

    tools = toolbox([note])
    execute_calls([[ToolCall("note", {"word": "first"}), ToolCall("note", {"word": "second"})]], [tools])
    assert seen == ["first", "second"]


def test_a_tool_that_does_not_answer_in_time_is_an_error_answer():
    release = threading.Event()

    def hang(x: int) -> str:
        """Hang.

        Args:
            x: anything.
        """
        release.wait(10)
        return "late"

    async def stall(x: int) -> str:
        """Stall.

        Args:
            x: anything.
        """
        await asyncio.sleep(10)
        return "late"

    async def own_timeout(x: int) -> str:
        """Raise a timeout of its own.

        Args:
            x: anything.
        """
        raise TimeoutError("upstream")

    tools = toolbox([hang, stall, own_timeout])
    calls = [[ToolCall("hang", {"x": 1})], [ToolCall("stall", {"x": 1}), ToolCall("own_timeout", {"x": 1})]]
    start = time.perf_counter()
    try:
        results = execute_calls(calls, [tools, tools], timeout=0.3)
    finally:
        release.set()
    assert time.perf_counter() - start < 2
    hung, stalled, own = results[0][0], results[1][0], results[1][1]
    assert hung.error and hung.timed_out and "did not answer within 0.3 s" in hung.content
    assert stalled.error and stalled.timed_out
    assert own.error and not own.timed_out and "TimeoutError: upstream" in own.content


# --------------------------------------------------------------------------------------------------- chat
@needs_tool_parsing
def test_a_huge_tool_answer_is_cut_by_characters_then_tokens_without_splitting_a_character():
    tokenizer = build_tool_tokenizer()
    tools = toolbox([hang_free])
    chat = ToolChat(tokenizer, schemas(tools), tokenizer.eos_token_id)
    from trl_ppo.agents.execution import ToolResult

    answer = chat.answer_ids([ToolResult("hang_free", "é" * 100)], max_tokens=5)  # "é": 2 byte tokens
    text = tokenizer.decode(answer.ids)
    assert answer.truncated == 1 and "\néé\n</tool_response>" in text and "\ufffd" not in text
    lengths = []
    encode = tokenizer.encode

    def spy(text, *args, **kwargs):
        lengths.append(len(text))
        return encode(text, *args, **kwargs)

    tokenizer.encode = spy
    huge = chat.answer_ids([ToolResult("hang_free", "x" * 1_000_000)], max_tokens=10)
    assert huge.truncated == 1 and max(lengths) < 1000  # never tokenized whole


def hang_free(x: int) -> int:
    """Return x.

    Args:
        x: anything.
    """
    return x


@needs_tool_parsing
def test_unparseable_tool_call_markup_is_answered_as_such():
    tokenizer = build_tool_tokenizer()
    tools = toolbox([hang_free])
    chat = ToolChat(tokenizer, schemas(tools), tokenizer.eos_token_id)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "q"}], tokenize=False,
                                           add_generation_prompt=True)
    turns = [tokenizer.encode(text, add_special_tokens=False) for text in
             ('<tool_call>{"name": "hang_free", "argu</tool_call><|im_end|>', "ok<|im_end|>")]
    played = run_turns([Episode(tokenizer.encode(prompt, add_special_tokens=False), tools)],
                       lambda contexts, room: [turns.pop(0)], chat, max_turns=3, budget=600)[0]
    text = tokenizer.decode(played.response)
    assert "could not be parsed" in text and "no tool named" not in text and played.tool_errors == 1


# ----------------------------------------------------------------------------------------- truncated episodes
def test_bootstrapping_a_truncated_episode_from_the_value_at_its_cut():
    """Hand-worked: rewards [0, 0, 1], values [0.5, 0.6, 0.8], gamma = lam = 1. Terminal: A = [0.5, 0.4, 0.2],
    returns 1 everywhere. Bootstrapped from V = 0.8 at the cut: the last reward becomes 1.8, A = [1.3, 1.2, 1.0],
    returns 1.8 everywhere. The second episode is not truncated and keeps its terminal numbers."""
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.8], [0.5, 0.6, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    truncated = torch.tensor([True, False])
    boosted = ppo.bootstrap_truncated_rewards(rewards, values, mask, truncated, gamma=1.0)
    assert torch.allclose(boosted, torch.tensor([[0.0, 0.0, 1.8], [0.0, 1.0, 0.0]]))
    advantages, returns = ppo.compute_gae(boosted, values, mask, gamma=1.0, lam=1.0)
    assert torch.allclose(advantages, torch.tensor([[1.3, 1.2, 1.0], [0.5, 0.4, 0.0]]))
    assert torch.allclose(returns, torch.tensor([[1.8, 1.8, 1.8], [1.0, 1.0, 0.0]]))
    # gamma = 0.5: the last reward gains 0.5 * 0.8
    assert ppo.bootstrap_truncated_rewards(rewards, values, mask, truncated, 0.5)[0, 2].item() == pytest.approx(1.4)


def test_leaving_truncated_episodes_out_of_the_loss():
    mask = torch.tensor([[True, True, False], [True, False, True]])
    kept = ppo.drop_truncated_episodes(mask, torch.tensor([False, True]))
    assert kept.tolist() == [[True, True, False], [False, False, False]]

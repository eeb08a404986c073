"""Running the tool calls of one turn of a batch of episodes. Failures are answers, not crashes: an unknown tool,
arguments that do not fit its signature, or a tool that raises give the model an error message (and are
counted); the run goes on. The `async` tools of the whole batch run concurrently, in one event loop.

A tool may return `(text, reward)`: the reward is that turn's (it lands on the model's last token of the turn,
`ppo.per_turn_token_rewards`)."""

from __future__ import annotations

import asyncio
import inspect
import json
import math
from dataclasses import dataclass

from ..rewards import MAX_ABS_SCORE, call_reward_function
from .tools import Tool


@dataclass(frozen=True)
class ToolCall:
    """A call the model wrote: the tool's name and its arguments (as parsed; not checked yet)."""

    name: str
    arguments: object


@dataclass(frozen=True)
class ToolResult:
    """What the model reads back (`content`), whether the call failed, and the turn reward the tool gave."""

    name: str
    content: str
    error: bool = False
    reward: float = 0.0


def execute_calls(calls: list[list[ToolCall]], toolboxes: list[dict[str, Tool]]) -> list[list[ToolResult]]:
    """The result of each call of each episode (`calls[i]` against `toolboxes[i]`), in the same order. Sync tools
    run one after another; all the `async` ones of the batch are awaited together."""
    results: list[list[ToolResult | None]] = [[None] * len(episode) for episode in calls]
    pending = []  # (episode, call index, name, coroutine factory)
    for i, (episode_calls, tools) in enumerate(zip(calls, toolboxes)):
        for j, call in enumerate(episode_calls):
            problem, bound = _bind(call, tools)
            if problem is not None:
                results[i][j] = ToolResult(call.name, problem, error=True)
            elif tools[call.name].is_async:
                pending.append((i, j, call.name, bound))
            else:
                results[i][j] = _run_sync(call.name, bound)
    if pending:
        for (i, j, name, _), result in zip(pending, _run_async([bound for *_, bound in pending])):
            results[i][j] = _as_result(name, result)
    return results


def _bind(call: ToolCall, tools: dict[str, Tool]):
    """(an error message or None, a zero-argument callable running the call)."""
    tool = tools.get(call.name)
    if tool is None:
        return f"Error: there is no tool named {call.name!r}; the tools are {sorted(tools)}.", None
    if not isinstance(call.arguments, dict):
        return f"Error: the arguments of {call.name} must be a JSON object, got {call.arguments!r}.", None
    try:
        inspect.signature(tool.function).bind(**call.arguments)
    except TypeError as error:
        return f"Error: bad arguments for {call.name}: {error}.", None
    return None, lambda: tool.function(**call.arguments)


def _run_sync(name: str, run) -> ToolResult:
    try:
        returned = run()
    except Exception as error:  # the tool's own failure is the model's to read, not the run's end
        returned = error
    return _as_result(name, returned)  # a non-finite turn reward is the tool's bug: it ends the run


def _run_async(runs: list) -> list:
    """Await every coroutine together; a raised exception is returned in place of its result."""

    async def gather():
        return await asyncio.gather(*(run() for run in runs), return_exceptions=True)

    return call_reward_function(gather)  # awaits it, also from inside a running loop (a notebook)


def _as_result(name: str, returned) -> ToolResult:
    if isinstance(returned, BaseException):
        return ToolResult(name, f"Error: {name} raised {type(returned).__name__}: {returned}", error=True)
    reward = 0.0
    # Only `(str, number)` is `(text, reward)`: `divmod(7, 2)` or `(48.85, 2.35)` are answers, and so is a bool.
    if (isinstance(returned, tuple) and len(returned) == 2 and isinstance(returned[0], str)
            and isinstance(returned[1], (int, float)) and not isinstance(returned[1], bool)):
        returned, reward = returned
        if not math.isfinite(reward):
            raise ValueError(f"Tool {name!r} returned the turn reward {reward}: a turn reward must be finite.")
        if abs(reward) > MAX_ABS_SCORE:  # as scores are refused: PPO squares rewards, which overflows
            raise ValueError(
                f"Tool {name!r} returned the turn reward {reward:g}, beyond ±{MAX_ABS_SCORE:g}: rescale the rewards "
                "that tool returns."
            )
    if not isinstance(returned, str):
        try:
            returned = json.dumps(returned)
        except (TypeError, ValueError):
            returned = str(returned)
    return ToolResult(name, returned, reward=float(reward))

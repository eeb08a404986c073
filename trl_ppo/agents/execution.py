"""Running the tool calls of one turn of a batch of episodes. Failures are answers, not crashes: an unknown tool,
arguments that do not fit its signature, markup that could not be parsed, a tool that raises, or one that does not
answer within `timeout` seconds give the model an error message (and are counted); the run goes on.

The calls of a batch run concurrently: the `async` tools on the run's one event loop (`async_loop`: what a tool
made on it at one turn still works at the next), each sync call in a daemon thread of its own (`TOOL_WORKERS` at
once), the sync calls of one episode in the order written (each may depend on the one before), those of different
episodes side by side. A sync call past its timeout is stopped at its next Python instruction
(`interrupts.Started.stop`) and gives its place up at once: however many calls hang, a healthy one starts at once.

A tool may return `(text, reward)`: the reward is that turn's (it lands on the model's last token of the turn,
`ppo.per_turn_token_rewards`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import math
import time
import traceback
from dataclasses import dataclass

from transformers.utils import logging

from .. import async_loop
from ..deadlines import LOOP_GRACE
from ..interrupts import TIMED_OUT as _TIMED_OUT
from ..interrupts import Failed, Started
from ..rewards import MAX_ABS_SCORE
from .tools import Tool

logger = logging.get_logger(__name__)
UNPARSED = object()  # the arguments of a call whose markup could not be parsed
# Sync tool calls running at once (over all episodes of a process), besides those stopped at their timeout.
TOOL_WORKERS = 16
_FAILED_TOOLS: set[str] = set()  # tools whose first failure this process has shown


@dataclass(frozen=True)
class ToolCall:
    """A call the model wrote: the tool's name and its arguments (as parsed; not checked yet)."""

    name: str
    arguments: object


@dataclass(frozen=True)
class ToolResult:
    """What the model reads back (`content`), whether the call failed (or timed out), and the turn reward the tool
    gave."""

    name: str
    content: str
    error: bool = False
    reward: float = 0.0
    timed_out: bool = False


def unparsed_call() -> ToolCall:
    """The call that stands for a turn whose tool-call markup the parser could not read."""
    return ToolCall("", UNPARSED)


def execute_calls(
    calls: list[list[ToolCall]], toolboxes: list[dict[str, Tool]], timeout: float | None = None
) -> list[list[ToolResult]]:
    """The result of each call of each episode (`calls[i]` against `toolboxes[i]`), in the same order; a call
    still running after `timeout` seconds (None: no limit) is stopped and answered as an error."""
    results: list[list[ToolResult | None]] = [[None] * len(episode) for episode in calls]
    jobs = [job for i in range(len(calls)) for job in _episode_jobs(calls[i], toolboxes[i], timeout, results[i])]
    if jobs:
        try:
            async_loop.run(_all(jobs), _loop_bound(calls, timeout))
        except TimeoutError:  # the calls not answered yet are answered below
            pass
    for episode_calls, episode_results in zip(calls, results):
        _answer_the_rest(episode_calls, episode_results, timeout)
    return results


class PendingCalls:
    """One episode's calls started on the run's loop and in threads, without waiting for them (the episode engine
    samples the other episodes meanwhile): `done()` says when `results()` will not wait. Bounded as
    `execute_calls` bounds a batch's calls."""

    def __init__(self, calls: list[ToolCall], tools: dict[str, Tool], timeout: float | None) -> None:
        self.calls, self.timeout, self._results = calls, timeout, [None] * len(calls)
        jobs = _episode_jobs(calls, tools, timeout, self._results)
        self.future = asyncio.run_coroutine_threadsafe(_all(jobs), async_loop.event_loop()) if jobs else None
        bound = _loop_bound([calls], timeout)
        self.deadline = None if bound is None else time.monotonic() + bound

    def done(self) -> bool:
        return self.future is None or self.future.done() or self.overdue()

    def overdue(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def results(self) -> list[ToolResult]:
        """The calls' results (waiting for them up to the bound); those not answered by then, as timeouts."""
        if self.future is not None and not self.future.done():
            remaining = None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)
            try:
                self.future.result(remaining)
            except concurrent.futures.TimeoutError:  # an async tool that never awaits blocks the loop
                self.future.cancel()
        _answer_the_rest(self.calls, self._results, self.timeout)
        return self._results


def _episode_jobs(calls: list[ToolCall], tools: dict[str, Tool], timeout: float | None, results: list) -> list:
    """The coroutines that fill `results` (one slot per call) with one episode's calls; calls that cannot be bound
    to a tool are answered at once. The async calls run side by side, the sync ones in the order written."""
    jobs, in_order = [], []  # in_order: this episode's sync calls, (index, name, zero-argument callable)
    for j, call in enumerate(calls):
        problem, bound = _bind(call, tools)
        if problem is not None:
            results[j] = ToolResult(call.name, problem, error=True)
        elif tools[call.name].is_async:
            jobs.append(_async_call(results, j, call.name, bound, timeout))
        else:
            in_order.append((j, call.name, bound))
    if in_order:
        jobs.append(_sync_calls(results, in_order, timeout))
    return jobs


def _loop_bound(calls: list[list[ToolCall]], timeout: float | None) -> float | None:
    """How long the loop may take over `calls`: each call waits at most `timeout` for a thread and `timeout` to
    return, an episode's calls one by one; a loop still busy after that is blocked by an async tool that never
    awaits, and its calls are given up."""
    return None if timeout is None else 2 * timeout * max(map(len, calls), default=0) + LOOP_GRACE


def _answer_the_rest(calls: list[ToolCall], results: list, timeout: float | None) -> None:
    for j, call in enumerate(calls):
        if results[j] is None:
            results[j] = _as_result(call.name, _TIMED_OUT, timeout)


async def _all(jobs) -> None:
    await asyncio.gather(*jobs)


async def _async_call(results: list, j: int, name: str, bound, timeout: float | None) -> None:
    async def call():
        return await bound()

    results[j] = _as_result(name, await _within(asyncio.ensure_future(call()), timeout), timeout)


async def _sync_calls(results: list, in_order: list, timeout: float | None) -> None:
    places = _places()
    for j, name, bound in in_order:
        # The clock starts with the call; waiting for a place (all taken by running calls) is bounded too.
        placed = await _within(asyncio.ensure_future(places.acquire()), timeout)
        if placed is _TIMED_OUT:
            results[j] = _as_result(name, _TIMED_OUT, timeout)
            continue
        loop, answered = asyncio.get_running_loop(), asyncio.Event()
        wake = lambda answered=answered: loop.call_soon_threadsafe(answered.set)  # noqa: E731  (this call's event)
        call = Started(bound, name=f"trl_ppo-tool-{name}", on_done=wake)
        try:
            waited = await _within(asyncio.ensure_future(answered.wait()), timeout)
        finally:
            places.release()  # at the timeout too: a hung call holds no place
        returned = _TIMED_OUT if waited is _TIMED_OUT else call.wait(0)
        if returned is _TIMED_OUT:
            call.stop()
        results[j] = _as_result(name, returned.error if isinstance(returned, Failed) else returned, timeout)


_places_by_loop: dict = {}


def _places() -> asyncio.Semaphore:
    """The run loop's semaphore of `TOOL_WORKERS` places for running sync calls."""
    loop = asyncio.get_running_loop()
    if loop not in _places_by_loop:
        _places_by_loop.clear()  # a new run loop (the old one closed): its semaphore is gone with it
        _places_by_loop[loop] = asyncio.Semaphore(TOOL_WORKERS)
    return _places_by_loop[loop]


async def _within(future: asyncio.Future, timeout: float | None):
    """The future's result, its exception, or `_TIMED_OUT` (it is then cancelled: a thread runs on to its end)."""
    done, _ = await asyncio.wait([future], timeout=timeout)
    if not done:
        future.cancel()
        return _TIMED_OUT
    return future.exception() or future.result()


def _bind(call: ToolCall, tools: dict[str, Tool]):
    """(an error message or None, a zero-argument callable running the call)."""
    if call.arguments is UNPARSED:
        return "Error: the tool call could not be parsed (malformed markup or JSON); no tool was run.", None
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


def _as_result(name: str, returned, timeout: float | None = None) -> ToolResult:
    if returned is _TIMED_OUT:
        message = f"Error: {name} did not answer within {timeout:g} s; the call was stopped."
        return ToolResult(name, message, error=True, timed_out=True)
    if isinstance(returned, BaseException):
        warn_first_failure(name, returned)
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


def warn_first_failure(name: str, error: BaseException) -> None:
    """The first exception of each tool, with its traceback, as a warning: the model reads every failure and
    `env/tool_errors` counts them, but a bug in a tool is found in the traceback."""
    if name in _FAILED_TOOLS:
        return
    _FAILED_TOOLS.add(name)
    trace = "".join(traceback.format_exception(type(error), error, error.__traceback__)).rstrip()
    logger.warning(f"Tool {name!r} raised (the model reads the error; later failures of it are counted in "
                   f"`env/tool_errors` without a warning):\n{trace}")

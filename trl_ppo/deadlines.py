"""Deadlines on the calls a run makes into user code, tools aside (`agents/execution.py` bounds those): reward
functions (`reward_timeout`) and environments' `reset`, `get_reward` and `close` (`environment_timeout`).

A call with a deadline runs in a thread of its own, and the coroutine an `async` function returns is awaited on the
run's event loop (`async_loop`). At the deadline a coroutine is cancelled. A sync function cannot be stopped from
outside in Python: its thread is abandoned and runs on until the call returns (a daemon thread: it does not keep
the process alive at exit). The thread carries the caller's torch settings that are per thread (grad mode,
autocast, the current CUDA device). Without a deadline (None) a call is made in the caller's thread, as before.

`Deadlines.call` retries a call that passed its deadline or raised a transient error (`is_transient`), then raises
`UserCallError` naming the function. This process's timeouts and retries are counted for the metrics
`calls/timeouts` and `calls/retries` (`take_counts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers.utils import logging

from . import async_loop
from .config_deadlines import DeadlineConfig

logger = logging.get_logger(__name__)

TIMED_OUT = object()  # the outcome of a call still running at its deadline
# The class names (of an exception or one of its bases) of transient errors, by their endings: besides the built-in
# `TimeoutError` and `ConnectionError`, those of HTTP clients (requests' `Timeout` and `ConnectionError`, httpx's
# `TimeoutException`, `ConnectError` and `NetworkError`, aiohttp's `ClientConnectionError` and `ServerTimeoutError`,
# openai's `APITimeoutError`, `APIConnectionError` and `RateLimitError`), none of which trl_ppo imports.
TRANSIENT_ENDINGS = ("Timeout", "TimeoutError", "TimeoutException", "ConnectionError", "ConnectError",
                     "NetworkError", "RateLimitError")  # fmt: skip
# Seconds the run's event loop gets beyond a deadline to cancel what passed it; a loop still busy then is blocked
# (a coroutine that never awaits), and its calls are given up as timed out.
LOOP_GRACE = 5.0

_counts = {"timeouts": 0, "retries": 0}  # this process's, since `take_counts` last read them
_counts_lock = threading.Lock()


class UserCallError(RuntimeError):
    """A reward function, `get_reward` or `reset` failed on every try (its deadline passed, or it raised a transient
    error), called `sys.exit()` or raised `KeyboardInterrupt` in its thread, or failed on another process: the run
    stops."""


@dataclass(frozen=True)
class Failed:
    """The outcome of a call that raised `error`."""

    error: BaseException


def is_transient(error: BaseException) -> bool:
    """Whether `error` may pass on a retry: a timeout, a lost connection or a rate limit (`TRANSIENT_ENDINGS`)."""
    if isinstance(error, (TimeoutError, ConnectionError)):
        return True
    return any(cls.__name__.endswith(TRANSIENT_ENDINGS) for cls in type(error).__mro__)


def take_counts() -> tuple[int, int]:
    """(timeouts, retries) of this process since the last call, which sets them back to 0."""
    with _counts_lock:
        counts = (_counts["timeouts"], _counts["retries"])
        _counts.update(timeouts=0, retries=0)
    return counts


def _count(kind: str, number: int = 1) -> None:
    with _counts_lock:
        _counts[kind] += number


def call_all_within(functions: Sequence[Callable[[], object]], seconds: float | None) -> list:
    """Call each of `functions` (no arguments; an `async` one's coroutine is awaited), all at once and within
    `seconds` together -> per function its result, a `Failed`, or `TIMED_OUT` (counted). With `seconds` None, one
    after the other in this thread, without a limit."""
    if seconds is None:
        return [_call_here(function) for function in functions]
    deadline, settings = time.monotonic() + seconds, _torch_settings()
    running = [_Running(function, settings) for function in functions]
    outcomes = [call.outcome(_left(deadline)) for call in running]
    pending = [i for i, outcome in enumerate(outcomes) if inspect.isawaitable(outcome)]
    if pending:
        for i, outcome in zip(pending, _await_within([outcomes[i] for i in pending], deadline)):
            outcomes[i] = outcome
    _count("timeouts", sum(outcome is TIMED_OUT for outcome in outcomes))
    return outcomes


def _call_here(function: Callable[[], object]):
    try:
        return async_loop.resolve(function())
    except Exception as error:
        return Failed(error)


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _torch_settings() -> Callable[[], contextlib.AbstractContextManager]:
    """A context manager factory that gives another thread this thread's grad mode, autocast and CUDA device (torch
    keeps each per thread): a reward function runs as it would in the trainer's thread."""
    grad = torch.is_grad_enabled()
    casts = [(kind, torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda") if torch.is_autocast_enabled(kind)]
    cuda_device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    @contextlib.contextmanager
    def settings():
        if cuda_device is not None:
            torch.cuda.set_device(cuda_device)
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(grad))
            for kind, dtype in casts:
                stack.enter_context(torch.autocast(kind, dtype=dtype))
            yield

    return settings


class _Running:
    """One call, started in a daemon thread of its own."""

    def __init__(self, function: Callable[[], object], settings) -> None:
        self._done, self._outcome = threading.Event(), None

        def run() -> None:
            try:
                with settings():
                    self._outcome = function()
            except BaseException as error:  # handed to the caller, who decides
                self._outcome = Failed(error)
            finally:
                self._done.set()

        threading.Thread(target=run, name="trl_ppo-user-call", daemon=True).start()

    def outcome(self, seconds: float):
        return self._outcome if self._done.wait(seconds) else TIMED_OUT


def _await_within(awaitables: list, deadline: float) -> list:
    """Await `awaitables` side by side on the run's loop until `deadline` -> each one's result, `Failed` or
    `TIMED_OUT` (it is cancelled)."""

    async def side_by_side() -> list:
        tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
        done, _ = await asyncio.wait(tasks, timeout=_left(deadline))
        outcomes = []
        for task in tasks:
            if task not in done:
                task.cancel()
                outcomes.append(TIMED_OUT)
            elif task.cancelled():
                outcomes.append(Failed(asyncio.CancelledError()))
            else:
                outcomes.append(task.result() if task.exception() is None else Failed(task.exception()))
        return outcomes

    try:
        return async_loop.run(side_by_side(), timeout=_left(deadline) + LOOP_GRACE)
    except TimeoutError:  # the loop is blocked by a coroutine that never awaits: nothing on it can finish
        return [TIMED_OUT] * len(awaitables)


def _setting(args, name: str):
    return getattr(args, name, DeadlineConfig.__dataclass_fields__[name].default)


def describe(outcome, seconds: float | None) -> str:
    """What went wrong with a call, in words: "did not return within 2 s", "raised ConnectionError: refused"."""
    if outcome is TIMED_OUT:
        return f"did not return within {seconds:g} s"
    return f"raised {type(outcome.error).__name__}: {outcome.error}"


@dataclass(frozen=True)
class Deadlines:
    """A run's deadlines on reward functions and environments (`config_deadlines.DeadlineConfig`), and the
    retries of the calls that may be retried."""

    reward: float | None = None
    environment: float | None = None
    retries: int = 0
    backoff: float = 1.0

    @classmethod
    def from_config(cls, args) -> "Deadlines":
        """From a `PPOConfig` (or any object: a setting it lacks has `DeadlineConfig`'s default)."""
        value = functools.partial(_setting, args)
        return cls(value("reward_timeout"), value("environment_timeout"), value("user_call_retries"),
                   value("user_call_backoff"))  # fmt: skip

    def call(self, function: Callable[[], object], name: str, seconds: float | None, setting: str):
        """`function()` (awaited when it returns a coroutine) within `seconds` -> its result. A call that passes
        its deadline or raises a transient error is tried again, `retries` times, `backoff` seconds later (doubled
        each time); then `UserCallError` names it (`name`, e.g. "Reward function 'judge'") and the setting that
        bounds it (`setting`). Any other error is raised at once, as it was."""
        tries = self.retries + 1
        for attempt in range(tries):
            outcome = call_all_within([function], seconds)[0]
            if outcome is not TIMED_OUT and not isinstance(outcome, Failed):
                return outcome
            if isinstance(outcome, Failed) and not isinstance(outcome.error, Exception):
                raise _ended_its_thread(name, outcome.error) from outcome.error
            if isinstance(outcome, Failed) and not is_transient(outcome.error):
                raise outcome.error
            if attempt + 1 < tries:
                delay = self.backoff * 2**attempt
                _count("retries")
                logger.warning(f"{name} {describe(outcome, seconds)}; trying again in {delay:g} s "
                               f"(try {attempt + 2} of {tries}).")
                time.sleep(delay)
        waits = " and ".join(f"{self.backoff * 2**attempt:g} s" for attempt in range(self.retries))
        tried = f"each of its {tries} tries ({waits} apart)" if self.retries else "its only try (no retries)"
        raise UserCallError(
            f"{name} {describe(outcome, seconds)} on {tried}: the run stops. Nothing since the last checkpoint is "
            f"kept, and that checkpoint is intact: resume from it (`resume_from_checkpoint=True`, "
            f"`--resume_from_checkpoint latest`) once {name} answers, or change `{setting}` (None: no limit) or "
            "`user_call_retries`."
        ) from (outcome.error if isinstance(outcome, Failed) else None)


def _ended_its_thread(name: str, error: BaseException) -> UserCallError:
    """`sys.exit()` or `KeyboardInterrupt` raised by a function in its own thread (a real Ctrl-C reaches the main
    thread only): re-raised as it was, it ended the process with no message (or left the other processes of a
    distributed run waiting); instead an error names the function."""
    shown = f"{type(error).__name__}({error})" if str(error) else type(error).__name__
    return UserCallError(
        f"{name} raised {shown} (`sys.exit()` or an interrupt from inside it): the run stops. Nothing since the "
        f"last checkpoint is kept, and that checkpoint is intact: resume from it once {name} no longer does so."
    )

"""Deadlines on the calls a run makes into user code, tools aside (`agents/execution.py` bounds those): reward
functions (`reward_timeout`) and environments' `reset`, `get_reward` and `close` (`environment_timeout`).

One call made from the main thread (a reward function, a `reset`, a `get_reward`) runs in the main thread, as it
would without a deadline, and is interrupted there at its deadline (`interrupts.call_in_main_thread`): `signal`
(math_verify's timeout), thread-unsafe libraries and the CUDA device work, and a call past its deadline is stopped,
not left running beside its retry. Several calls at once (a batch's `close`), or calls made from another thread, run
each in a daemon thread of its own that carries the caller's per-thread torch settings (grad mode, autocast, the
CUDA device), stopped at the deadline as far as Python can (`interrupts.Started`). The coroutine an `async`
function returns is awaited on the run's event loop (`async_loop`) and cancelled at the deadline. Without a deadline
(None) a call is made in the caller's thread, as before.

`Deadlines.call` retries a call that passed its deadline or raised a transient error (`is_transient`), then raises
`UserCallError` naming the function. This process's timeouts and retries are counted for the metrics
`calls/timeouts` and `calls/retries` (`take_counts`). `call_bound` is the longest a call with its retries may take,
which `config_checks` keeps under `ddp_timeout` in a run of several processes.
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
from .interrupts import TIMED_OUT, Failed, Started, call_in_main_thread, can_interrupt_here

logger = logging.get_logger(__name__)

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


def is_transient(error: BaseException) -> bool:
    """Whether `error` may pass on a retry: a timeout, a lost connection or a rate limit (`TRANSIENT_ENDINGS`)."""
    if isinstance(error, (TimeoutError, ConnectionError)):
        return True
    return any(cls.__name__.endswith(TRANSIENT_ENDINGS) for cls in type(error).__mro__)


def add_counts(timeouts: int, retries: int) -> None:
    """Count calls that another process made for this one (the sampler process of `max_staleness`)."""
    with _counts_lock:
        _counts["timeouts"] += timeouts
        _counts["retries"] += retries


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
    deadline = time.monotonic() + seconds
    if len(functions) == 1 and can_interrupt_here():
        outcomes = [call_in_main_thread(functions[0], seconds)]
    else:
        outcomes = _in_threads(functions, deadline)
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


def _in_threads(functions: Sequence[Callable[[], object]], deadline: float) -> list:
    """Each call in a daemon thread of its own with this thread's torch settings; those still running at `deadline`
    are stopped as far as Python can (`Started.stop`) and answered `TIMED_OUT`."""
    settings = _torch_settings()

    def with_settings(function):
        def call():
            with settings():
                return function()

        return call

    running = [Started(with_settings(function)) for function in functions]
    outcomes = [call.wait(_left(deadline)) for call in running]
    for call, outcome in zip(running, outcomes):
        if outcome is TIMED_OUT:
            call.stop()
    return outcomes


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

    def call_bound(self, seconds: float | None) -> float | None:
        """The longest a retried call with deadline `seconds` may take: every try, and the waits between them."""
        if seconds is None:
            return None
        return (self.retries + 1) * seconds + self.backoff * (2**self.retries - 1)

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

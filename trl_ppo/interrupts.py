"""Stopping a call into user code at its deadline, for real, instead of abandoning it.

In the main thread (`call_in_main_thread`; reward functions, an environment's `reset` and `get_reward`): the call
runs where it would run without a deadline, so `signal.alarm` (math_verify's own timeout), thread-unsafe libraries
and a CUDA device work as their users wrote them. At the deadline a watchdog thread sends the main thread
`INTERRUPT_SIGNAL`, whose handler raises `CallInterrupted` inside the call, as Ctrl-C raises `KeyboardInterrupt`: a
sleep, a lock, a socket read or a Python loop is left at once and its frames unwound, so nothing of it runs beside
the retry. The signal is sent again every `RESEND` seconds until the call is gone, so code that catches one gets the
next. Code that stays in C without returning to the interpreter (a C loop that checks no signals) stops only when it
returns.

In another thread (`Started`; sync tools, batches of `close`, and any call made where signals cannot reach: a
`train()` called from a thread other than the main one): each call has a daemon thread of its own, and at its
deadline `CallInterrupted` is raised in that thread (`PyThreadState_SetAsyncExc`), which stops Python code at its
next instruction; a thread blocked in C (a sleep, a lock, a socket) stays blocked, using no CPU, until that returns,
then ends. Either way the caller has its answer at the deadline, and nothing waits for a hung call's thread.

`CallInterrupted` is a `BaseException`, so that `except Exception:` in user code lets it through.
"""

from __future__ import annotations

import ctypes
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

TIMED_OUT = object()  # the outcome of a call still running at its deadline
RESEND = 0.5  # seconds between interrupts of a call that is still running after its deadline
# A real-time signal nothing else sends (Linux); SIGUSR2 where Python has none (macOS, or Python < 3.11).
INTERRUPT_SIGNAL = signal.SIGRTMIN + 5 if hasattr(signal, "SIGRTMIN") else getattr(signal, "SIGUSR2", None)


class CallInterrupted(BaseException):
    """Raised inside a call into user code at its deadline (never seen outside trl_ppo's wrappers)."""


@dataclass(frozen=True)
class Failed:
    """The outcome of a call that raised `error`."""

    error: BaseException


def can_interrupt_here() -> bool:
    """Whether a call made in this thread can be interrupted by a signal: the main thread, on a POSIX system."""
    return (INTERRUPT_SIGNAL is not None and hasattr(signal, "pthread_kill")
            and threading.current_thread() is threading.main_thread())  # fmt: skip


def call_in_main_thread(function: Callable[[], object], seconds: float):
    """`function()` in this (the main) thread, interrupted at `seconds` -> its result, `Failed(error)` or
    `TIMED_OUT`. `KeyboardInterrupt` (a real Ctrl-C, in the main thread) is raised as it is."""
    watchdog = _Watchdog(threading.main_thread().ident, seconds)
    previous = signal.signal(INTERRUPT_SIGNAL, watchdog.handle)
    try:
        watchdog.start()
        try:
            return function()
        except KeyboardInterrupt:
            raise
        except CallInterrupted:
            return TIMED_OUT
        except BaseException as error:  # `SystemExit` too: the caller names the function
            return Failed(error)
        finally:
            watchdog.disarm()
    except CallInterrupted:  # sent as the call returned: the deadline had passed
        return TIMED_OUT
    finally:
        signal.signal(INTERRUPT_SIGNAL, previous)


class _Watchdog:
    """Sends `INTERRUPT_SIGNAL` to the main thread at the deadline, then every `RESEND` seconds, until disarmed.
    Disarming and sending share a lock, so that no signal is sent once `disarm` returned."""

    def __init__(self, main_ident: int, seconds: float) -> None:
        self._main, self._seconds = main_ident, seconds
        self._lock, self._stop, self._armed = threading.Lock(), threading.Event(), True

    def handle(self, signum, frame) -> None:
        if self._armed:  # a signal handled after `disarm` is spent
            raise CallInterrupted

    def start(self) -> None:
        threading.Thread(target=self._watch, name="trl_ppo-deadline", daemon=True).start()

    def disarm(self) -> None:
        with self._lock:
            self._armed = False
            self._stop.set()

    def _watch(self) -> None:
        wait = self._seconds
        while not self._stop.wait(wait):
            with self._lock:
                if not self._armed:
                    return
                signal.pthread_kill(self._main, INTERRUPT_SIGNAL)
            wait = RESEND


class Started:
    """One call running in a daemon thread of its own. `wait(seconds)` -> its result, `Failed(error)` or
    `TIMED_OUT`; `stop()` raises `CallInterrupted` in it (after the deadline: the thread is not reused, so the
    exception can only land in this call or in the thread's own last lines)."""

    def __init__(self, function: Callable[[], object], name: str = "trl_ppo-user-call", on_done=None) -> None:
        """`on_done()`, if given, is called in the call's thread once its outcome is known (e.g. to wake a loop)."""
        self._done, self._outcome = threading.Event(), None

        def run() -> None:
            try:
                try:
                    self._outcome = function()
                except BaseException as error:  # handed to the caller, who decides
                    self._outcome = TIMED_OUT if isinstance(error, CallInterrupted) else Failed(error)
                finally:
                    self._done.set()
                    if on_done is not None:
                        on_done()
            except BaseException:  # a stop that landed after the call had ended, or `on_done`'s error: too late
                pass

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, seconds: float | None):
        return self._outcome if self._done.wait(seconds) else TIMED_OUT

    def stop(self) -> None:
        """Raise `CallInterrupted` in the call's thread, if it still runs (CPython; elsewhere it runs on)."""
        if self._done.is_set() or not self._thread.is_alive() or not hasattr(ctypes, "pythonapi"):
            return
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread.ident),
                                                   ctypes.py_object(CallInterrupted))  # fmt: skip

"""One event loop for the whole run, on a daemon thread, as TRL's GRPOTrainer has: every coroutine of a run (async
tools, an environment's async `reset` / `get_reward` / `close`, async reward functions) is awaited on it, so what one
of them made on the loop (a lock, an HTTP session, a subprocess) still works at the next turn and the next update.
A fresh loop per call (`asyncio.run`) would break those with "attached to a different loop"."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None


def event_loop() -> asyncio.AbstractEventLoop:
    """The run's event loop, started on a daemon thread at the first call."""
    global _loop, _thread
    with _lock:
        if _loop is None or _loop.is_closed() or _thread is None or not _thread.is_alive():
            loop, ready = asyncio.new_event_loop(), threading.Event()

            def serve() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            _thread = threading.Thread(target=serve, name="trl_ppo-event-loop", daemon=True)
            _thread.start()
            ready.wait()
            _loop = loop
    return _loop


def run(awaitable, timeout: float | None = None):
    """Await `awaitable` on the run's loop and return its result (its exception is raised here). Callable from any
    thread but the loop's own, a notebook's running loop included. After `timeout` seconds (None: none) it is
    cancelled and `TimeoutError` raised: the guard against a loop that a coroutine blocks (one that never awaits)."""
    loop = event_loop()
    if threading.current_thread() is _thread:
        raise RuntimeError("A coroutine of the run awaited another one synchronously on the run's own event loop.")
    future = asyncio.run_coroutine_threadsafe(_await(awaitable), loop)
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:  # on Python 3.10 not yet the built-in one
        if not future.done():
            future.cancel()
            raise TimeoutError(f"not done within {timeout:g} s on the run's event loop") from None
        raise


def is_async_callable(function) -> bool:
    """Whether calling `function` returns a coroutine: an `async def` function, or an object whose `__call__` is one
    (`functools.partial` of either included)."""
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(getattr(function, "__call__", None))


def resolve(value):
    """`value`, or what it resolves to when it is awaitable (what an `async def` method returned)."""
    return run(value) if inspect.isawaitable(value) else value


async def _await(awaitable):
    return await awaitable

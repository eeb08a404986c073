"""One event loop for the whole run, on a daemon thread, as TRL's GRPOTrainer has: every coroutine of a run (async
tools, an environment's async `reset` / `get_reward` / `close`, async reward functions) is awaited on it, so what one
of them made on the loop (a lock, an HTTP session, a subprocess) still works at the next turn and the next update.
A fresh loop per call (`asyncio.run`) would break those with "attached to a different loop".

Sync tools run in a bounded pool of daemon threads (`tool_pool`), so that the calls of several episodes overlap and a
call that never returns can be abandoned after a timeout without keeping the process alive at its exit (the threads
of `concurrent.futures.ThreadPoolExecutor` are joined then: one hung call, and a finished run never exited)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import queue
import threading

# Sync tool calls running at once (over all episodes of a process). A call abandoned after its timeout keeps its
# thread until it returns: a bound, so that hung tools cannot pile up threads without limit.
TOOL_WORKERS = 16

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_pool: DaemonPool | None = None


class DaemonPool(concurrent.futures.Executor):
    """At most `workers` daemon threads running what is submitted, in order, a thread started only when none is idle.
    As `ThreadPoolExecutor`, except that its threads are daemons that nothing joins: the interpreter exits while one
    still runs an abandoned call (it is stopped there, as `deadlines.py`'s threads are)."""

    def __init__(self, workers: int, name: str) -> None:
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._threads: list[threading.Thread] = []
        self._workers, self._name, self._lock = workers, name, threading.Lock()

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._work.put((future, fn, args, kwargs))
        with self._lock:
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._workers:
                thread = threading.Thread(target=self._serve, name=f"{self._name}_{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
        return future

    def _serve(self) -> None:
        while True:
            future, fn, args, kwargs = self._work.get()
            if future.set_running_or_notify_cancel():  # False: cancelled before it started, never run
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as error:  # the caller's: a tool's failure is an answer
                    future.set_exception(error)
            del future, fn, args, kwargs
            self._idle.release()


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


def tool_pool() -> DaemonPool:
    """The bounded pool of daemon threads the sync tools run in (`TOOL_WORKERS` threads)."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = DaemonPool(TOOL_WORKERS, "trl_ppo-tool")
    return _pool


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


def resolve(value):
    """`value`, or what it resolves to when it is awaitable (what an `async def` method returned)."""
    return run(value) if inspect.isawaitable(value) else value


async def _await(awaitable):
    return await awaitable

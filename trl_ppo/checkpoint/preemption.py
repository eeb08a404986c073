"""Preemption: SIGTERM / SIGINT turned into a request that the training loop honours between the steps of an
update (all processes agreeing), so that the run stops at a point it can resume from exactly."""

from __future__ import annotations

import os
import signal
import threading

import torch

_active: list[PreemptionHandler] = []  # the handlers installed in this process, innermost last


def _defaults_in_a_forked_child() -> None:
    """A process forked during training (a reward's `multiprocessing.Pool` worker) gets SIGTERM and SIGINT back as
    Python starts them: with the trainer's handler it ignored `Pool.terminate()`'s SIGTERM, and the pool waited for
    it forever."""
    if _active:
        _active.clear()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_defaults_in_a_forked_child)


class PreemptionHandler:
    """While active, SIGTERM and SIGINT only set `requested`; the trainer checks it between the steps of an
    update, writes a checkpoint and exits. A second SIGINT interrupts at once (the usual KeyboardInterrupt)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        self.requested = signal.Signals(signum).name
        signal.signal(signal.SIGINT, self._previous.get(signal.SIGINT, signal.default_int_handler))

    def __enter__(self) -> "PreemptionHandler":
        if threading.current_thread() is threading.main_thread():  # signals can only be caught there
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
            _active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        if self in _active:
            _active.remove(self)


def stop_requested(preemption: PreemptionHandler, accelerator) -> bool:
    """Whether any process got SIGTERM/SIGINT (all processes must stop at the same point)."""
    flag = torch.tensor([1.0 if preemption.requested else 0.0], device=accelerator.device)
    return bool(accelerator.reduce(flag, reduction="sum").item() > 0)

"""Asynchronous sampling (`max_staleness` = k >= 1): a sampler process samples and scores the next k batches while
the trainer trains on the current one.

The schedule is fixed, so that runs repeat: batch j is sampled by the policy after update `sampling_version(j, k)`
= max(0, j - 1 - k), exactly k updates older than the one batch j trains (fewer in the first k updates). The
trainer sends batch j to the sampler when it publishes that version, and publishes version v only once the sampler
has taken every batch that needs version v - 1 (`AsyncSampler.publish`): the sampler then always finds the version
its batch names. The weights travel through shared memory (`SharedWeights`): the trainer copies its policy's tensors
in, the sampler copies them into its own policy; nothing goes through disk.

The sampler process is forked from the trainer's when the run's updates begin, so it holds a copy of everything the
trainer had (the models, the reward functions, the tokenizer, its RNG) without pickling any of it; its work is a
callable of the trainer's (`collect(batch) -> (rollout, scores_per_reward, played)`, `played` what else the trainer
needs about the episodes: the agents' records of them). What it sends back is the rollout with
the behaviour policy's log-probs, the reference's and the scores; the trainer recomputes the proximal policy's
log-probs and the values with its current weights. CPU only: a process that has touched CUDA cannot be forked;
the sampler computes on one thread.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..checkpoint.rng import capture_rng_state, restore_rng_state

# The key of the sampler's state in a checkpoint's per-process RNG file (`AsyncSampler.state_dict`).
ASYNC_STATE = "async_sampler"
POLL_SECONDS = 1.0  # how often a waiting trainer checks that the sampler process is alive


def sampling_version(batch: int, max_staleness: int) -> int:
    """The policy version (updates applied) that samples batch `batch` (1-based) under `max_staleness`."""
    return max(0, batch - 1 - max_staleness)


class SharedWeights:
    """A module's tensors (`state_dict`) in shared memory, and the version (updates applied) they hold."""

    def __init__(self, module: nn.Module) -> None:
        self.tensors = {name: tensor.detach().to("cpu", copy=True).share_memory_()
                        for name, tensor in module.state_dict().items()}  # fmt: skip
        self.version = multiprocessing.get_context("fork").Value("q", 0)  # its lock guards the tensors too

    @torch.no_grad()
    def publish(self, module: nn.Module, version: int) -> None:
        with self.version.get_lock():
            for name, tensor in module.state_dict().items():
                self.tensors[name].copy_(tensor)
            self.version.value = version

    @torch.no_grad()
    def load_into(self, module: nn.Module) -> int:
        """Copy the shared tensors into `module` -> the version they were."""
        with self.version.get_lock():
            module.load_state_dict(self.tensors)
            return self.version.value


@dataclass
class Sampled:
    """One batch as the sampler sent it: its index (1-based), the policy version that sampled it, the rollout, the
    scores per reward and what else `collect` returned about the episodes (`played`), and the sampler's RNG state
    after it (what a resume restores)."""

    batch: int
    version: int
    rollout: object  # a `Rollout`
    scores_per_reward: dict
    played: object
    rng: dict


def _sampler_loop(collect: Callable, policy: nn.Module, weights: SharedWeights, inbox, outbox, taken) -> None:
    """The sampler process: take (batch index, batch, version, RNG state to restore or None) from `inbox` until
    None, and put a `Sampled` (or ("error", index, traceback)) on `outbox`."""
    # A signal to the process group (Ctrl-C, a scheduler's SIGTERM) is the trainer's to handle: it finishes its
    # update, saves what this process sampled ahead, then stops it. Without a trainer this process ends itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    trainer = os.getppid()
    # OpenMP's threads do not survive a fork (a parallel region in the child would wait for them forever): the
    # sampler runs on one thread, as DataLoader workers do.
    torch.set_num_threads(1)
    loaded = None
    while (item := _next_item(inbox, trainer)) is not None:
        index, batch, version, rng = item
        try:
            if rng is not None:
                restore_rng_state(rng)
            if loaded != version:
                loaded = weights.load_into(policy)
                if loaded != version:
                    raise RuntimeError(f"batch {index} is to be sampled by version {version}, shared: {loaded}")
            taken.value = index
            outbox.put(Sampled(index, version, *collect(batch), capture_rng_state()))
        except BaseException:  # noqa: BLE001  (everything goes back to the trainer, which raises it)
            outbox.put(("error", index, traceback.format_exc()))
            return


def _next_item(inbox, trainer: int):
    """The next item of `inbox`, or None once the trainer process is gone (killed: nobody is left to stop us)."""
    while True:
        try:
            return inbox.get(timeout=POLL_SECONDS)
        except queue.Empty:
            if os.getppid() != trainer:
                return None


class AsyncSampler:
    """The trainer's side of the sampler process: it sends batches ahead, receives them in order, publishes the
    weights after each update, and saves / restores what is in flight at a checkpoint.

    `collect(batch)`: the sampler's work; `policy`: the module whose weights the sampler samples with (the sampler's
    copy is the forked one); `batches`: the data iterator (the trainer's `data.batches_forever`); `last_batch`: the
    run's last update. `restored`: a `state_dict` of a checkpoint (the batches it had sampled ahead)."""

    def __init__(
        self,
        collect: Callable,
        policy: nn.Module,
        max_staleness: int,
        batches: Iterator[dict],
        done_updates: int,
        last_batch: int,
        restored: dict | None = None,
    ) -> None:
        self.max_staleness, self.batches, self.last_batch = max_staleness, batches, last_batch
        self.weights = SharedWeights(policy)
        self.weights.version.value = done_updates
        context = multiprocessing.get_context("fork")
        self.inbox, self.outbox, self.taken = context.Queue(), context.Queue(), context.Value("q", 0)
        self.received: dict[int, Sampled] = {}
        self.consumed = self.sent = done_updates  # batches up to here were trained on before this sampler
        self.rng = None  # the sampler's RNG after the last batch received: a resume gives it to the next batch
        if restored is not None:
            self.received = {item.batch: item for item in restored["pending"]}
            self.sent, self.rng = max(self.received, default=done_updates), restored["rng"]
        self.taken.value = self.sent
        self.process = context.Process(
            target=_sampler_loop, args=(collect, policy, self.weights, self.inbox, self.outbox, self.taken),
            daemon=True, name="trl_ppo-sampler",
        )  # fmt: skip
        self.process.start()
        for batch in range(self.sent + 1, min(done_updates + 1 + max_staleness, last_batch) + 1):
            self._send(batch)

    def _send(self, batch: int) -> None:
        rng, self.rng = self.rng, None  # a restored RNG goes with the first batch sampled after the resume
        self.inbox.put((batch, next(self.batches), sampling_version(batch, self.max_staleness), rng))
        self.sent = batch

    def next(self, batch: int) -> Sampled:
        """The sampled batch `batch`, waiting for it."""
        while batch not in self.received:
            self._store(self._receive())
        self.consumed = batch
        return self.received.pop(batch)

    def _store(self, item: Sampled) -> None:
        self.received[item.batch] = item

    def _receive(self) -> Sampled:
        while True:
            try:
                item = self.outbox.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if not self.process.is_alive():
                    raise RuntimeError(
                        f"The sampler process (max_staleness) died with exit code {self.process.exitcode} before "
                        "sending its batch; the last checkpoint is intact."
                    ) from None
                continue
            if isinstance(item, tuple):  # ("error", index, traceback)
                raise RuntimeError(f"The sampler process failed on batch {item[1]}:\n{item[2]}")
            return item

    def publish(self, policy: nn.Module, version: int) -> None:
        """After update `version`: once the sampler has taken every batch that samples with version - 1, share
        the new weights and send the batch that samples with them."""
        needed = min(version + self.max_staleness, self.last_batch)  # the last batch of version - 1
        while self.taken.value < needed:
            if not self.process.is_alive():
                self._store(self._receive())  # a batch sent before it stopped, or the error that stopped it
            self.process.join(timeout=0.01)
        self.weights.publish(policy, version)
        if version + 1 + self.max_staleness <= self.last_batch:
            self._send(version + 1 + self.max_staleness)

    def state_dict(self) -> dict:
        """Everything in flight, for a checkpoint: every batch sent, sampled (waiting for those still sampling), and
        the sampler's RNG after the last of them."""
        while any(batch not in self.received for batch in range(self.consumed + 1, self.sent + 1)):
            self._store(self._receive())
        pending = [self.received[batch] for batch in sorted(self.received)]
        return {"pending": pending, "rng": pending[-1].rng if pending else self.rng}

    def close(self) -> None:
        """Stop the sampler process (what it was sampling is dropped: a checkpoint has what a resume needs)."""
        if self.process.is_alive():
            self.inbox.put(None)
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

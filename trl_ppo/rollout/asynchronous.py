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
callable of the trainer's (`collect(index, batch) -> (rollout, scores_per_reward, extra)`, `extra` what else the
trainer needs: the agents' records of the episodes, the counts of calls into user code that timed out). What it
sends back is the rollout with the behaviour policy's log-probs, the reference's and the scores; the trainer
recomputes the proximal policy's log-probs and the values with its current weights. CPU only: the sampler runs on
one thread, and uses no CUDA (a forked process cannot).
"""

from __future__ import annotations

import io
import mmap
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
    """A module's tensors (`state_dict`) in memory shared with the forked sampler (one anonymous shared mapping:
    inherited by the fork, and not `/dev/shm`, which containers keep small), and the version (updates applied)
    they hold."""

    def __init__(self, module: nn.Module, version: int = 0) -> None:
        state = {name: tensor.detach() for name, tensor in module.state_dict().items()}
        sizes = [tensor.numel() * tensor.element_size() for tensor in state.values()]
        self._memory = mmap.mmap(-1, max(1, sum(sizes)))  # MAP_SHARED | MAP_ANONYMOUS
        self.tensors, offset = {}, 0
        for (name, tensor), size in zip(state.items(), sizes):
            view = torch.frombuffer(self._memory, dtype=tensor.dtype, count=tensor.numel(), offset=offset)
            self.tensors[name] = view.view(tensor.shape)
            offset += size
        self.version = multiprocessing.get_context("fork").Value("q", version)  # its lock guards the tensors too
        self.publish(module, version)

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
    scores per reward and what else `collect` returned (`extra`: the agents' records of the episodes, the calls
    into user code that timed out), and the sampler's RNG state after it (what a resume restores)."""

    batch: int
    version: int
    rollout: object  # a `Rollout`
    scores_per_reward: dict
    extra: dict
    rng: dict


def _pack(item) -> bytes:
    """`item` as bytes for a queue. Tensors travel by value: torch's own queues would pass each through a file
    descriptor served by the sending process, which a sampler that failed (or was killed) no longer serves."""
    buffer = io.BytesIO()
    torch.save(item, buffer)
    return buffer.getvalue()


def _unpack(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def _sampler_loop(collect: Callable, policy: nn.Module, weights: SharedWeights, inbox, outbox, taken) -> None:
    """The sampler process: take (batch index, batch, version, RNG state to restore or None) from `inbox` until
    None, and put a `Sampled` (or ("error", index, traceback)) on `outbox`. After an error it only waits for the
    None: a process that ends with its last message unread would block on it."""
    # A signal to the process group (Ctrl-C, a scheduler's SIGTERM) is the trainer's to handle: it finishes its
    # update, saves what this process sampled ahead, then stops it. Without a trainer this process ends itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    trainer = os.getppid()
    # OpenMP's threads do not survive a fork (a parallel region in the child would wait for them forever): the
    # sampler runs on one thread, as DataLoader workers do.
    torch.set_num_threads(1)
    loaded, failed = None, False
    while (item := _next_item(inbox, trainer)) is not None:
        if failed:
            continue
        index, batch, version, rng = _unpack(item)
        try:
            if rng is not None:
                restore_rng_state(rng)
            if loaded != version:
                loaded = weights.load_into(policy)
                if loaded != version:
                    raise RuntimeError(f"batch {index} is to be sampled by version {version}, shared: {loaded}")
            taken.value = index
            # the CPU's generators only: asking for CUDA's would initialise CUDA in a forked process
            outbox.put(_pack(Sampled(index, version, *collect(index, batch), capture_rng_state(cuda=False))))
        except BaseException:  # noqa: BLE001  (everything goes back to the trainer, which raises it)
            outbox.put(_pack(("error", index, traceback.format_exc())))
            failed = True


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

    `collect(index, batch)`: the sampler's work on batch `index`; `policy`: the module whose weights the sampler
    samples with (the sampler's copy is the forked one); `batches`: the data iterator (the trainer's
    `data.batches_forever`); `last_batch`: the run's last update. `restored`: a `state_dict` of a checkpoint (the
    batches it had sampled ahead), written with the same `max_staleness`."""

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
        if restored is not None and restored["max_staleness"] != max_staleness:
            raise ValueError(
                f"The checkpoint was written by a run with `max_staleness={restored['max_staleness']}`, whose "
                f"batches sampled ahead follow that schedule: resume with it (not {max_staleness}), or start anew."
            )
        self.max_staleness, self.batches, self.last_batch = max_staleness, batches, last_batch
        self.weights = SharedWeights(policy, done_updates)
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
        self.inbox.put(_pack((batch, next(self.batches), sampling_version(batch, self.max_staleness), rng)))
        self.sent = batch

    def next(self, batch: int) -> Sampled:
        """The sampled batch `batch`, waiting for it."""
        while batch not in self.received:
            self._poll(POLL_SECONDS)
        self.consumed = batch
        return self.received.pop(batch)

    def _poll(self, seconds: float) -> None:
        """Take what the sampler sent within `seconds`, if anything; its failure, or its death, raised here."""
        try:
            data = self.outbox.get(timeout=seconds)
        except queue.Empty:
            if not self.process.is_alive():
                raise RuntimeError(
                    f"The sampler process (max_staleness) died with exit code {self.process.exitcode} before "
                    "sending its batch; the last checkpoint is intact."
                ) from None
            return
        item = _unpack(data)
        if isinstance(item, tuple):  # ("error", index, traceback)
            raise RuntimeError(f"The sampler process failed on batch {item[1]}:\n{item[2]}")
        self.received[item.batch] = item

    def publish(self, policy: nn.Module, version: int) -> None:
        """After update `version`: once the sampler has taken every batch that samples with version - 1, share
        the new weights and send the batch that samples with them."""
        needed = min(version + self.max_staleness, self.last_batch)  # the last batch of version - 1
        while self.taken.value < needed:
            self._poll(0.01)  # what it sends meanwhile is kept; a failure is raised
        self.weights.publish(policy, version)
        if version + 1 + self.max_staleness <= self.last_batch:
            self._send(version + 1 + self.max_staleness)

    def state_dict(self) -> dict:
        """Everything in flight, for a checkpoint: every batch sent, sampled (waiting for those still sampling), and
        the sampler's RNG after the last of them."""
        while any(batch not in self.received for batch in range(self.consumed + 1, self.sent + 1)):
            self._poll(POLL_SECONDS)
        pending = [self.received[batch] for batch in sorted(self.received)]
        rng = pending[-1].rng if pending else self.rng
        return {"pending": pending, "rng": rng, "max_staleness": self.max_staleness}

    def close(self) -> None:
        """Stop the sampler process (what it was sampling is dropped: a checkpoint has what a resume needs)."""
        if self.process.is_alive():
            self.inbox.put(None)
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

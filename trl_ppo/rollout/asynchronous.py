"""Asynchronous sampling (`max_staleness` = k >= 1): a sampler process samples and scores the next k batches while
the trainer trains on the current one.

The schedule is fixed, so that runs repeat: batch j is sampled by the policy after update `sampling_version(j, k, s)`
= max(s, j - 1 - k), exactly k updates older than the one batch j trains (fewer in the first k updates after the
sampler starts at version s: 0 for a new run, the checkpoint's update for a resumed one, whose older weights are
gone; the batches a checkpoint holds keep the versions that sampled them, whatever `max_staleness` it was). The
trainer sends batch j to the sampler when it publishes that version, and publishes version v only once the sampler
has taken every batch that needs version v - 1 (`AsyncSampler.publish`): the sampler then always finds the version
its batch names. The weights travel through shared memory (`SharedWeights`): the trainer copies its policy's tensors
in, the sampler copies them into its own policy; nothing goes through disk.

The sampler process is forked from the trainer's when the run's updates begin, so it holds a copy of everything the
trainer had (the models, the reward functions, the tokenizer, its RNG) without pickling any of it; its work is two
callables of the trainer's, sampling and scoring (`SamplerWork`). A batch is scored while the next one samples
(a slow reward, a judge, costs the sampler no sampling time), and `async` reward functions score several batches
at once. Sampling draws from a generator of its own (`SamplerWork.generator`), never the process-wide ones that user
code draws from while it scores on the other thread; both are saved with each batch (`SamplerRng`), so that a
resumed run draws as the uninterrupted one would. What it sends back is the rollout with the behaviour policy's
log-probs, the reference's and the scores; the trainer recomputes the proximal policy's log-probs and the values
with its current weights. CPU only: the sampler's torch runs on one thread, and uses no CUDA (a forked process
cannot).
"""

from __future__ import annotations

import functools
import io
import mmap
import multiprocessing
import os
import queue
import signal
import threading
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from ..checkpoint.rng import capture_rng_state, restore_rng_state

# The key of the sampler's state in a checkpoint's per-process RNG file (`AsyncSampler.state_dict`).
ASYNC_STATE = "async_sampler"
POLL_SECONDS = 1.0  # how often a waiting trainer checks that the sampler process is alive


def sampling_version(batch: int, max_staleness: int, first_version: int = 0) -> int:
    """The policy version (updates applied) that samples batch `batch` (1-based) under `max_staleness`, for a
    sampler started with the weights of version `first_version`."""
    return max(first_version, batch - 1 - max_staleness)


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
    into user code that timed out), and the sampler's RNG state after it (`SamplerRng`: what a resume restores)."""

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


@dataclass(frozen=True)
class SamplerWork:
    """The sampler process's work on a batch, given by the trainer: `sample(index, batch, generator) -> rollout`
    (with the behaviour policy's and the reference's log-probs), then `score(index, rollout, batch) ->
    (scores_per_reward, extra)`, `extra` what else the trainer needs (the agents' records of the episodes, the calls
    into user code that timed out).

    `generator`: what sampling draws from, seeded from the run's seed, so that user code drawing from the
    process-wide generators while a batch is scored beside the sampling cannot change what is sampled. None where
    the sampling cannot take one (transformers' `generate`): it then draws from the process-wide generators, and
    must not run beside scoring (`scorers` 0).

    `scorers`: how a batch's scoring runs beside the next batch's sampling. 0: not at all, both on the process's
    main thread one after the other (agents: a batch's environments live from its sampling to its scoring). 1: the
    next batch samples on a thread of its own while this one is scored on the main thread (where user code runs,
    as it would without `max_staleness`: signal-based timeouts work). n > 1: up to n batches scored at once, each
    on a thread that waits for its `async` reward functions on the run's event loop (their calls overlap there, as
    an HTTP judge's requests do); only for rewards that are all `async` functions."""

    sample: Callable
    score: Callable
    scorers: int = 1
    generator: torch.Generator | None = None
    # called in the sampler process with the version its policy holds after each load of the shared weights (the
    # vLLM backend pushes them to the sampler's engine); None: nothing to do
    loaded: Callable[[int], None] | None = None

    def __post_init__(self) -> None:
        if self.generator is None and self.scorers:
            raise ValueError("Sampling that draws from the process-wide generators cannot run beside scoring.")


class SamplerRng:
    """The sampler's random state after a batch, as `Sampled.rng` holds it: its sampling generator's (after the
    batch sampled) and the process-wide generators' (after it was scored: what user code drew from), restored
    before the first batch a resumed sampler samples."""

    @staticmethod
    def capture(sampling: torch.Tensor | None) -> dict:
        # the CPU's generators only: asking for CUDA's would initialise CUDA in a forked process
        return {"sampling": sampling, "process": capture_rng_state(cuda=False)}

    @staticmethod
    def restore(state: dict, generator: torch.Generator | None) -> None:
        if "process" not in state:  # a checkpoint written before the sampler had a generator of its own
            return restore_rng_state(state)
        restore_rng_state(state["process"])
        if generator is not None and state["sampling"] is not None:
            generator.set_state(state["sampling"])


def _sampler_loop(work: SamplerWork, policy: nn.Module, weights: SharedWeights, inbox, outbox, taken) -> None:
    """The sampler process: take (batch index, batch, version, RNG state to restore or None) from `inbox` until
    None; sample, score, and put a `Sampled` (or ("error", index, traceback)) on `outbox`, in the order of the
    batches. After an error it only waits for the None: a process that ends with its last message unread would
    block on it."""
    # A signal to the process group (Ctrl-C, a scheduler's SIGTERM) is the trainer's to handle: it finishes its
    # update, saves what this process sampled ahead, then stops it. Without a trainer this process ends itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # OpenMP's threads do not survive a fork (a parallel region in the child would wait for them forever): the
    # sampler's torch runs on one thread, as DataLoader workers do.
    torch.set_num_threads(1)
    delivery = _Delivery(outbox, work.score, work.scorers)
    sampled = _sampled_batches(work, policy, weights, inbox, taken, delivery)
    if work.scorers == 0:
        for item in sampled:
            delivery.submit(item)
    else:
        ready = queue.Queue()
        threading.Thread(target=_hand_over, args=(sampled, ready), daemon=True, name="trl_ppo-sampling").start()
        for item in iter(ready.get, None):
            delivery.submit(item)
    delivery.close()


def _hand_over(items: Iterator, ready: queue.Queue) -> None:
    """Put every item on `ready`, then None (also when taking one failed: the main thread must not wait on)."""
    try:
        for item in items:
            ready.put(item)
    finally:
        ready.put(None)


def _sampled_batches(work: SamplerWork, policy: nn.Module, weights: SharedWeights, inbox, taken, delivery):
    """Yield (index, version, batch, rollout, the sampling generator's state after it), or ("error", index,
    traceback), for each item of `inbox` until None; once a batch failed, nothing more."""
    generator = work.generator
    trainer = os.getppid()
    loaded = None
    while (item := _next_item(inbox, trainer)) is not None:
        if delivery.failed:
            continue
        index, batch, version, rng = _unpack(item)
        try:
            if rng is not None:
                SamplerRng.restore(rng, generator)
            if loaded != version:
                loaded = weights.load_into(policy)
                if loaded != version:
                    raise RuntimeError(f"batch {index} is to be sampled by version {version}, shared: {loaded}")
                if work.loaded is not None:
                    work.loaded(loaded)
            taken.value = index
            rollout = work.sample(index, batch, generator)
            yield index, version, batch, rollout, None if generator is None else generator.get_state()
        except BaseException:  # noqa: BLE001  (everything goes back to the trainer, which raises it)
            yield "error", index, traceback.format_exc()
    delivery.closed = True  # the trainer stopped the sampler: what is still being scored is not wanted


class _Delivery:
    """Scores the sampled batches and puts them on `outbox` in their order, however many are scored at once."""

    def __init__(self, outbox, score: Callable, scorers: int) -> None:
        self.outbox, self.score = outbox, score
        self.pool = ThreadPoolExecutor(scorers, thread_name_prefix="trl_ppo-scoring") if scorers > 1 else None
        self.previous: threading.Event | None = None  # set once the batch before is on `outbox`
        self.failed = self.closed = False

    def submit(self, sampled: tuple) -> None:
        before, self.previous = self.previous, threading.Event()
        job = functools.partial(self._deliver, sampled, before, self.previous)
        if self.pool is None:
            job()
        else:
            self.pool.submit(job)

    def _deliver(self, sampled: tuple, before: threading.Event | None, done: threading.Event) -> None:
        item = sampled
        if sampled[0] != "error":
            index, version, batch, rollout, sampling_rng = sampled
            try:
                scores_and_extra = self.score(index, rollout, batch)
                item = Sampled(index, version, rollout, *scores_and_extra, SamplerRng.capture(sampling_rng))
            except BaseException:  # noqa: BLE001
                item = ("error", index, traceback.format_exc())
        if before is not None:
            before.wait()
        if not (self.failed or self.closed):
            self.outbox.put(_pack(item))
            self.failed = isinstance(item, tuple)
        done.set()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


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

    `work`: the sampler's work on a batch (`SamplerWork`); `policy`: the module whose weights the sampler
    samples with (the sampler's copy is the forked one); `batches`: the data iterator (the trainer's
    `data.batches_forever`); `done_updates`: the updates applied to `policy` (the version the sampler starts
    with); `last_batch`: the run's last update. `restored`: a `state_dict` of a checkpoint (the batches it had
    sampled ahead, trained on as they are, whatever `max_staleness` wrote it)."""

    def __init__(
        self,
        work: SamplerWork,
        policy: nn.Module,
        max_staleness: int,
        batches: Iterator[dict],
        done_updates: int,
        last_batch: int,
        restored: dict | None = None,
    ) -> None:
        self.max_staleness, self.batches, self.last_batch = max_staleness, batches, last_batch
        self.first_version = done_updates  # the oldest weights this sampler will ever hold
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
            target=_sampler_loop, args=(work, policy, self.weights, self.inbox, self.outbox, self.taken),
            daemon=True, name="trl_ppo-sampler",
        )  # fmt: skip
        self.process.start()
        for batch in range(self.sent + 1, min(done_updates + 1 + max_staleness, last_batch) + 1):
            self._send(batch)

    def _send(self, batch: int) -> None:
        """Send `batch` to be sampled, unless it was (a checkpoint of a larger `max_staleness` holds it)."""
        if batch <= self.sent:
            return
        rng, self.rng = self.rng, None  # a restored RNG goes with the first batch sampled after the resume
        version = sampling_version(batch, self.max_staleness, self.first_version)
        self.inbox.put(_pack((batch, next(self.batches), version, rng)))
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

"""Episodes that do not wait for each other: multi-turn episodes played with continuous batching over their turns.

The lockstep loop (`turn_loop.run_turns`) samples one turn of every active episode per call, then runs all their
tool calls, then prefills every context again: each turn waits for the slowest generation and the slowest tool of
the batch. Here an episode is a row of one decoding batch while its model writes; when its turn ends, the row
leaves, its tool calls start (`execution.PendingCalls`) and the other rows decode on. When the calls answer, the
episode joins again at the next decoding step: only its new tokens (the turn's last token and the tool answer) are
prefilled, against its own KV cache kept from before the call.

What the update sees is what the lockstep loop gives (the same `Episode` records, masks, turn rewards, tokens
exactly as sampled, `turn_loop.episodes_rollout`), plus `sampler_logprobs`: each model token's log-prob under the
sampler, to compare with the training forward's (`agreement.py`). Each episode draws its tokens from a generator of
its own, seeded from the run's RNG (or the generator it is given), so the tokens an episode samples do not depend
on which others share its decoding steps; what can still vary between runs of the same seed is the floating-point
result of a batched forward over a different set of rows (when tools finish in another order), which can flip a
draw that was at a tie.

The KV caches are transformers' `DynamicCache` of full-attention layers; a model whose cache is anything else
(sliding-window or hybrid layers) raises `CacheNotPlain` at its first prefill, before any token is drawn, and the
caller plays the lockstep loop instead.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ..agents.chat import ToolChat
from ..agents.execution import PendingCalls
from ..compat import returned_cache
from .turn_loop import Episode, add_model_turn, add_tool_answers

Layers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each `[B, H, L, D]`


class CacheNotPlain(RuntimeError):
    """The model's KV cache is not a list of full-attention layers that rows can be cut from and joined into."""


@dataclass(frozen=True)
class TurnLimits:
    """How long episodes may go: `max_turns` model turns and `budget` tokens after each prompt."""

    max_turns: int
    budget: int
    stop_token_id: int
    temperature: float
    max_tool_response_length: int | None = None
    tool_timeout: float | None = None


@dataclass
class EpisodeRow:
    """An episode being played: the turn being written, its tool calls, and (for this module's engine) what its
    cache holds and what it still has to prefill. The vLLM engine's episodes (`vllm_episodes.py`) use the same
    record and the same turn ends (`end_turn`, `answered_rows`); vLLM keeps their caches."""

    episode: Episode
    generator: torch.Generator
    cache: Layers | None = None  # `[1, H, cached, D]` per layer while the episode is out of the batch
    cached: int = 0  # context tokens in the cache
    pending: list[int] = field(default_factory=list)  # context tokens not in the cache yet
    turn: list[int] = field(default_factory=list)
    turn_logprobs: list[float] = field(default_factory=list)
    calls: PendingCalls | None = None

    def room(self, budget: int) -> int:
        """Tokens the turn being written may still take."""
        return budget - len(self.episode.response) - len(self.turn)


def play_episodes(
    episodes: list[Episode], forward: Callable, device: torch.device, cache_keyword: str, chat: ToolChat,
    limits: TurnLimits, generator: torch.Generator | None = None,
) -> list[Episode]:
    """Play `episodes` to their end, as `turn_loop.run_turns` would, with continuous batching (see the module).
    `forward(**inputs)` runs the policy LM on `device` (no gradients) and returns its output: `logits` and the
    cache under `cache_keyword`. The episodes' generators are seeded from `generator` (None: the process-wide one)."""
    joining = [EpisodeRow(e, own, pending=list(e.query))
               for e, own in zip(episodes, episode_generators(len(episodes), generator, device))]
    batch, waiting = _DecodingBatch(forward, device, cache_keyword, limits.temperature), []
    while joining or batch.rows or waiting:
        for row in joining:
            batch.add(row, batch.prefill(row))
        if batch.rows:
            waiting += [row for row in batch.decode_step(limits) if end_turn(row, chat, limits)]
        joining, waiting = answered_rows(waiting, chat, limits, block=not batch.rows)
    return episodes


def episode_generators(count: int, generator: torch.Generator | None, device="cpu") -> list[torch.Generator]:
    """A generator of its own for each of `count` episodes, seeded from `generator` (None: the process-wide one),
    so that runs repeat with the seed and an episode's draws do not depend on the others'."""
    seeds = torch.randint(2**62, (count,), generator=generator).tolist()
    return [torch.Generator(device).manual_seed(seed) for seed in seeds]


def end_turn(row: EpisodeRow, chat: ToolChat, limits: TurnLimits) -> bool:
    """Append the finished turn to its episode and start its tool calls -> whether the episode waits for them."""
    episode = row.episode
    calls = add_model_turn(episode, row.turn, chat, limits.budget)
    episode.sampler_logprobs += row.turn_logprobs
    row.pending, row.turn, row.turn_logprobs = [row.turn[-1]], [], []  # the last token was never fed
    if calls is not None and episode.turns >= limits.max_turns:
        episode.done = episode.truncated = True  # its calls would never be answered
    if episode.done:
        row.cache = None  # nothing more to decode: its memory goes
        return False
    row.calls = PendingCalls(calls, episode.tools, limits.tool_timeout)
    return True


def answered_rows(
    waiting: list[EpisodeRow], chat: ToolChat, limits: TurnLimits, block: bool
) -> tuple[list[EpisodeRow], list[EpisodeRow]]:
    """The episodes whose calls have answered, their answers appended (ready to join unless that ended them), and
    those still waiting. With `block` (nothing is decoding), wait for the first answer."""
    if block and waiting and not any(row.calls.done() for row in waiting):
        futures = [row.calls.future for row in waiting if row.calls.future is not None]
        deadlines = [row.calls.deadline for row in waiting if row.calls.deadline is not None]
        timeout = None if len(deadlines) < len(waiting) else max(min(deadlines) - time.monotonic(), 0.0)
        concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)
    ready, still = [], []
    for row in waiting:
        if not row.calls.done():
            still.append(row)
            continue
        episode, before = row.episode, len(row.episode.response)
        add_tool_answers(episode, row.calls.results(), chat, limits.budget, limits.max_tool_response_length)
        row.calls = None
        added = episode.response[before:]
        episode.sampler_logprobs += [0.0] * len(added)
        if episode.done:
            row.cache = None
        else:
            row.pending += added
            ready.append(row)
    return ready, still


class _DecodingBatch:
    """The rows decoding together: their caches left-padded into one `[B, H, L, D]` per layer (each row's tokens
    the last `lengths[i]` columns), and the logits of each row's next token."""

    def __init__(self, forward: Callable, device: torch.device, cache_keyword: str, temperature: float) -> None:
        self.forward, self.device, self.keyword, self.temperature = forward, device, cache_keyword, temperature
        self.rows: list[EpisodeRow] = []
        self.layers: Layers | None = None
        self.lengths: list[int] = []
        self.logits: torch.Tensor | None = None  # [B, V]

    def prefill(self, row: EpisodeRow) -> torch.Tensor:
        """Run the row's pending tokens through the model against its own cache -> the next token's logits `[V]`."""
        ids = torch.tensor([row.pending], dtype=torch.long, device=self.device)
        # No cache given at the first prefill: the model makes its own, of the layer kinds it needs (checked below).
        cache = {} if row.cache is None else {self.keyword: DynamicCache(ddp_cache_data=row.cache)}
        total = row.cached + ids.size(1)
        output = self.forward(
            input_ids=ids, attention_mask=torch.ones(1, total, dtype=torch.long, device=self.device),
            position_ids=torch.arange(row.cached, total, device=self.device)[None], use_cache=True, logits_to_keep=1,
            **cache,
        )  # fmt: skip
        row.cache, row.cached, row.pending = _plain_layers(returned_cache(output)), row.cached + ids.size(1), []
        return output.logits[0, -1]

    def add(self, row: EpisodeRow, logits: torch.Tensor) -> None:
        """Join `row` (its cache `[1, H, n, D]` per layer) to the batch, left-padding the shorter side."""
        new_width = max(self.lengths + [row.cached])
        joined = []
        for i, (keys, values) in enumerate(row.cache):
            own = (_left_pad(keys, new_width), _left_pad(values, new_width))
            if self.layers is None:
                joined.append(own)
            else:
                old_keys, old_values = self.layers[i]
                joined.append((torch.cat([_left_pad(old_keys, new_width), own[0]]),
                               torch.cat([_left_pad(old_values, new_width), own[1]])))  # fmt: skip
        self.layers, row.cache = joined, None
        self.rows.append(row)
        self.lengths.append(row.cached)
        self.logits = logits[None] if self.logits is None else torch.cat([self.logits, logits[None]])

    def decode_step(self, limits: TurnLimits) -> list[EpisodeRow]:
        """Draw one token for every row; rows whose turn ended (stop token, or no room left) leave the batch with
        their caches -> those rows. The others' tokens go through the model."""
        log_probs = torch.log_softmax(self.logits.float() / self.temperature, dim=-1)
        probs = log_probs.exp()
        tokens = torch.cat([torch.multinomial(p, 1, generator=row.generator) for row, p in zip(self.rows, probs)])
        for row, token, log_prob in zip(self.rows, tokens.tolist(), log_probs.gather(1, tokens[:, None]).tolist()):
            row.turn.append(token)
            row.turn_logprobs.append(log_prob[0])
        stop, budget = limits.stop_token_id, limits.budget
        ended = [i for i, row in enumerate(self.rows) if row.turn[-1] == stop or row.room(budget) <= 0]
        finished = self._remove(ended)
        if self.rows:
            kept = [i for i in range(len(tokens)) if i not in set(ended)]
            self._feed(tokens[kept])
        return finished

    def _remove(self, indices: list[int]) -> list[EpisodeRow]:
        """Take the rows at `indices` out, each with its own cache cut from the batch's."""
        if not indices:
            return []
        width, gone = max(self.lengths), set(indices)
        removed = []
        for i in indices:
            row, length = self.rows[i], self.lengths[i]
            row.cache = [(k[i : i + 1, :, width - length :], v[i : i + 1, :, width - length :]) for k, v in self.layers]
            row.cached = length
            removed.append(row)
        keep = [i for i in range(len(self.rows)) if i not in gone]
        self.rows = [self.rows[i] for i in keep]
        self.lengths = [self.lengths[i] for i in keep]
        if not keep:
            self.layers, self.logits = None, None
            return removed
        index = torch.tensor(keep, device=self.logits.device)
        trim = width - max(self.lengths)  # columns now padding in every row
        self.layers = [(k[index][:, :, trim:], v[index][:, :, trim:]) for k, v in self.layers]
        self.logits = self.logits[index]
        return removed

    def _feed(self, tokens: torch.Tensor) -> None:
        """One decoding step of the batch on `tokens` `[B]`."""
        width = max(self.lengths)
        lengths = torch.tensor(self.lengths, device=tokens.device)
        columns = torch.arange(width + 1, device=tokens.device)
        attention_mask = (columns[None] >= (width - lengths)[:, None]).long()
        output = self.forward(
            input_ids=tokens[:, None], attention_mask=attention_mask, position_ids=lengths[:, None], use_cache=True,
            **{self.keyword: DynamicCache(ddp_cache_data=self.layers)},
        )  # fmt: skip
        self.layers = _plain_layers(returned_cache(output))
        self.lengths = [length + 1 for length in self.lengths]
        self.logits = output.logits[:, -1]


def _plain_layers(cache) -> Layers:
    """The (keys, values) of each layer of a `DynamicCache` of full-attention layers; `CacheNotPlain` otherwise."""
    layers = getattr(cache, "layers", None)
    if layers is None or any(type(layer).__name__ != "DynamicLayer" for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers or []}) or [type(cache).__name__]
        raise CacheNotPlain(f"the model's KV cache is {', '.join(kinds)}, not full-attention DynamicLayers")
    return [(layer.keys, layer.values) for layer in layers]


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """`[B, H, n, D]` -> `[B, H, width, D]` with zero columns on the left (masked out of attention)."""
    missing = width - tensor.size(2)
    if missing == 0:
        return tensor
    return torch.cat([tensor.new_zeros(*tensor.shape[:2], missing, tensor.size(3)), tensor], dim=2)

"""Multi-turn episodes on the vLLM engine (`generation_backend='vllm'` with tools or environments).

Each model turn is one request to the engine: the episode's context as ids (its prompt and everything after it,
exactly as sampled and as the tools answered: nothing is decoded and tokenized again), at most the tokens the
episode's budget has left, stopping at the stop token. The engine batches the requests of every episode
continuously and, with its prefix cache, prefills only what the episode added since its last turn (whole KV blocks
are reused). When a turn ends, its tool calls start (`execution.PendingCalls`) and the engine steps on for the other
episodes; when they answer, the episode's next turn joins as a new request. The turn ends and the tool answers are
the local engine's (`engine.end_turn`, `engine.answered_rows`): the episodes are the same records, with the
engine's log-prob of each sampled token as `sampler_logprobs`.

Each episode draws its requests' seeds from a generator of its own, seeded from the run's RNG (or the generator
given), and vLLM samples a seeded request from a generator of its own: the tokens an episode samples do not depend
on which other requests share the engine's steps (up to the floating-point rounding of a batched forward).
"""

from __future__ import annotations

import itertools

import torch

from ..agents.chat import ToolChat
from .engine import EpisodeRow, TurnLimits, answered_rows, end_turn, episode_generators
from .turn_loop import Episode
from .vllm_engine import VLLMEngine, sampled_tokens


def play_on_engine(
    episodes: list[Episode], engine: VLLMEngine, chat: ToolChat | None, limits: TurnLimits,
    generator: torch.Generator | None = None, version: int | None = None,
) -> list[Episode]:
    """Play `episodes` to their end on `engine` (see the module), as `engine.play_episodes` would on the local
    model. `version`: the update the engine's weights must be from (refused otherwise, before any request)."""
    engine.check_version(version)
    requests = _Requests(engine, limits)
    waiting: list[EpisodeRow] = []
    try:
        for episode, own in zip(episodes, episode_generators(len(episodes), generator)):
            requests.add(EpisodeRow(episode, own))
        while requests.running or waiting:
            if requests.running:
                waiting += [row for row in requests.step() if end_turn(row, chat, limits)]
            ready, waiting = answered_rows(waiting, chat, limits, block=not requests.running)
            for row in ready:
                requests.add(row)
    finally:
        requests.abort()  # an error (a tool's, an interrupt) leaves no request behind in the engine
    return episodes


class _Requests:
    """The turns being written: one engine request each, by request id."""

    def __init__(self, engine: VLLMEngine, limits: TurnLimits) -> None:
        self.engine, self.limits = engine.llm.llm_engine, limits
        self.running: dict[str, EpisodeRow] = {}
        self._ids = itertools.count()

    def add(self, row: EpisodeRow) -> None:
        """Request the episode's next turn: its context in, at most the budget's remaining tokens out."""
        limits, context = self.limits, row.episode.context
        seed = int(torch.randint(2**31 - 1, (1,), generator=row.generator))
        params = VLLMEngine.params(row.room(limits.budget), limits.temperature, limits.stop_token_id, seed)
        request_id = str(next(self._ids))
        self.engine.add_request(request_id, {"prompt_token_ids": context}, params)
        self.running[request_id] = row

    def step(self) -> list[EpisodeRow]:
        """One engine step -> the rows whose turn it finished, with the turn's ids and log-probs."""
        finished = []
        for output in self.engine.step():
            if output.finished and output.request_id in self.running:
                row = self.running.pop(output.request_id)
                row.turn, row.turn_logprobs = sampled_tokens(output)
                finished.append(row)
        return finished

    def abort(self) -> None:
        if self.running:
            self.engine.abort_request(list(self.running))
            self.running.clear()

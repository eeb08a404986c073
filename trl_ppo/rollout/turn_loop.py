"""The turn loop: multi-turn episodes as token ids, then as a `Rollout`.

Each turn the model writes (the sampler is given, so the loop itself needs no model), its tool calls are parsed
and run, and the tool answers are appended as the chat template's ids (`chat.ToolChat.answer_ids`); the model's own
tokens are kept exactly as sampled. An episode ends when a turn has no tool call, at `max_turns` turns, when a turn
reaches the budget (`response_length` tokens after the prompt, model and tool tokens together) without its stop
token, when the tool answers would leave no room for another turn of the model, or when the episode's environment
says it is over (its `done` attribute is True once a turn's calls are answered: a game won or lost, a server's
`done`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.nn.utils.rnn import pad_sequence

from .. import ppo
from ..agents.chat import ToolChat
from ..agents.execution import ToolCall, ToolResult, execute_calls, unparsed_call
from ..agents.tools import Tool
from ..data import LeftPaddingCollator
from .record import Rollout

# sample_turn(contexts, max_new_tokens) -> the model's turn after each context: ids up to and including its stop
# token (all `max_new_tokens` of them when it did not stop).
TurnSampler = Callable[[list[list[int]], int], list[list[int]]]


@dataclass
class Episode:
    """One episode being played: its prompt ids, environment and tools, and everything written after the prompt."""

    query: list[int]
    tools: dict[str, Tool]
    environment: object | None = None
    response: list[int] = field(default_factory=list)
    model_mask: list[bool] = field(default_factory=list)  # True on the model's own tokens
    turn_rewards: list[float] = field(default_factory=list)  # one per model turn
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0  # calls abandoned after `tool_timeout` seconds (counted in `tool_errors` too)
    truncated_answers: int = 0  # tool answers cut to `max_tool_response_length`
    truncated: bool = False  # ended by the budget (or by `max_turns`) with the model still working
    done: bool = False
    # the sampler's log-prob of each token of `response` (0.0 on tool tokens), where the sampler gives them
    sampler_logprobs: list[float] = field(default_factory=list)

    @property
    def context(self) -> list[int]:
        return self.query + self.response

    @property
    def turns(self) -> int:
        return len(self.turn_rewards)


def run_turns(
    episodes: list[Episode],
    sample_turn: TurnSampler,
    chat: ToolChat | None,
    max_turns: int,
    budget: int,
    max_tool_response_length: int | None = None,
    any_process: Callable[[bool], bool] | None = None,
    idle_context: list[int] | None = None,
    tool_timeout: float | None = None,
) -> list[Episode]:
    """Play `episodes` to their end (see the module's docstring), at most `max_turns` turns of the model each and
    `budget` tokens after each prompt. Every active episode samples in the same call of `sample_turn` per turn; a
    tool call still running after `tool_timeout` seconds is answered as an error.

    `any_process(flag)`: whether `flag` holds on some process; given where sampling is a collective (ZeRO-3), so
    that a process whose episodes all ended keeps sampling (one token after `idle_context`) while others play on."""
    for turn in range(max_turns):
        active = [episode for episode in episodes if not episode.done]
        if any_process is not None and any_process(bool(active)) and not active:
            sample_turn([idle_context], 1)
            continue
        if not active:
            break
        room = max(budget - len(episode.response) for episode in active)
        written = sample_turn([episode.context for episode in active], room)
        calling = []
        for episode, ids in zip(active, written):
            calls = add_model_turn(episode, list(ids)[: budget - len(episode.response)], chat, budget)
            if calls is not None and turn == max_turns - 1:
                episode.done = episode.truncated = True  # its calls would never be answered
            elif calls is not None:
                calling.append((episode, calls))
        toolboxes = [episode.tools for episode, _ in calling]
        results = execute_calls([calls for _, calls in calling], toolboxes, tool_timeout)
        for (episode, _), answers in zip(calling, results):
            add_tool_answers(episode, answers, chat, budget, max_tool_response_length)
    return episodes


def add_model_turn(episode: Episode, ids: list[int], chat: ToolChat | None, budget: int) -> list[ToolCall] | None:
    """Append the model's turn -> its tool calls, or None when the episode ends with it."""
    prefix = episode.context
    episode.response += ids
    episode.model_mask += [True] * len(ids)
    episode.turn_rewards.append(0.0)
    stopped = chat is not None and len(ids) > 0 and ids[-1] == chat.stop_token_id
    if not stopped:  # cut by the budget (or no tools: a single-turn episode)
        episode.done, episode.truncated = True, chat is not None and len(ids) > 0
        return None
    calls, failed = chat.parse_tool_calls(ids, prefix)
    if failed:  # markup the parser cannot read: the model is told, as one failed call
        calls = [unparsed_call()]
    if not calls:
        episode.done = True
        return None
    if len(episode.response) >= budget:
        episode.done = episode.truncated = True
        return None
    return calls


def add_tool_answers(
    episode: Episode, answers: list[ToolResult], chat: ToolChat, budget: int, max_tokens: int | None
) -> None:
    """Append a turn's tool answers (ended instead when they would leave no room for the model)."""
    episode.tool_calls += len(answers)
    episode.tool_errors += sum(answer.error for answer in answers)
    episode.tool_timeouts += sum(answer.timed_out for answer in answers)
    episode.turn_rewards[-1] += sum(answer.reward for answer in answers)
    answer = chat.answer_ids(answers, max_tokens)
    episode.truncated_answers += answer.truncated
    if len(episode.response) + len(answer.ids) >= budget:
        episode.done = episode.truncated = True
        return
    episode.response += answer.ids
    episode.model_mask += [False] * len(answer.ids)
    if getattr(episode.environment, "done", False) is True:  # the environment ended it: no turn after the answer
        episode.done = True


def episodes_rollout(episodes: list[Episode], pad_token_id: int, response_length: int, device) -> Rollout:
    """The played episodes as a `Rollout` on `device`: prompts left-padded `[B, Lq]`, responses right-padded to
    `response_length` `[B, T]` with `response_mask` True on the model's tokens and `response_attention_mask` on all
    of them (tool answers included), and `turn_rewards` `[B, K]` (K: the most turns of an episode)."""
    batch = LeftPaddingCollator(pad_token_id)([{"input_ids": episode.query} for episode in episodes])
    queries, query_mask = batch["input_ids"].to(device), batch["attention_mask"].to(device).bool()

    def padded(rows, value, dtype):
        rows = [torch.tensor(row, dtype=dtype) for row in rows] + [torch.zeros(response_length, dtype=dtype)]
        return pad_sequence(rows, batch_first=True, padding_value=value)[:-1].to(device)

    responses = padded([episode.response for episode in episodes], pad_token_id, torch.long)
    response_mask = padded([episode.model_mask for episode in episodes], False, torch.bool)
    attended = padded([[True] * len(episode.response) for episode in episodes], False, torch.bool)
    turns = max(episode.turns for episode in episodes)
    turn_rewards = torch.tensor([e.turn_rewards + [0.0] * (turns - e.turns) for e in episodes], device=device)
    truncated = torch.tensor([episode.truncated for episode in episodes], device=device)
    sampler_logprobs = None
    if all(len(episode.sampler_logprobs) == len(episode.response) for episode in episodes):
        rows = [episode.sampler_logprobs for episode in episodes]
        sampler_logprobs = padded(rows, 0.0, torch.float32).masked_fill(~response_mask, ppo.INVALID_LOGPROB)
    return Rollout(
        queries,
        query_mask,
        responses,
        response_mask,
        response_attention_mask=attended,
        turn_rewards=turn_rewards,
        truncated=truncated,
        sampler_logprobs=sampler_logprobs,
    )

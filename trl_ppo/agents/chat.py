"""The tokenizer's side of tool use: parsing the tool calls the model wrote, and the token ids of the tool answers.

Token in, token out: the model's own tokens are never decoded and encoded again into the episode. Each turn's
tool answers are appended as the ids the chat template gives for those tool messages: the template is rendered
for a conversation ending with the model's tool calls, and again with the tool messages (and the prompt of the
next assistant turn) after them; the text added after the model's stop token is encoded. This is only right for
a chat template that never rewrites earlier turns (prefix-preserving), which `ToolChat` checks at construction.

Tool calls are parsed with transformers' `tokenizer.parse_response(ids, prefix=..., tools=...)`, which reads
the tokenizer's `response_template` (the API of transformers 5.24; older releases had a `response_schema`
instead, which is not supported: `ToolChat` names the version).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import transformers

from .execution import ToolCall, ToolResult

TESTED_TRANSFORMERS = "5.24"
# A token spans at most this many characters in the answers that matter (BPE merges of long runs can exceed it;
# then the character cut is the one that binds, and the answer is still counted as cut).
CHARS_PER_TOKEN = 16
_PROBE_ARGUMENT = "probe-7"  # a string a template renders verbatim, to find the tool answer in the rendering


@dataclass(frozen=True)
class ToolAnswer:
    """The ids appended after a turn's stop token: the tool messages, and the next assistant turn's prompt."""

    ids: list[int]
    truncated: int  # how many of the tool answers were cut to `max_tool_response_length` tokens


class ToolChat:
    """Parse tool calls from a turn, and render tool answers as ids, with `tokenizer`'s chat template and
    `response_template`. Refuses (at construction, before any compute) a tokenizer that cannot do both, or whose
    chat template rewrites earlier turns. `tools`: the JSON schemas the model is shown (`tools.schemas`)."""

    def __init__(self, tokenizer, tools: list[dict], stop_token_id: int | None) -> None:
        self.tokenizer, self.tools, self.stop_token_id = tokenizer, tools, stop_token_id
        check_parsing_api(tokenizer)
        if stop_token_id is None:
            raise ValueError(
                "Tools need a stop token that ends each turn of the model, and none is set: set `stop_token='eos'` "
                "(or `stop_token_id`) in the config. A turn without one cannot be told from one cut by the budget."
            )
        self.stop_text = tokenizer.decode([stop_token_id])
        self._check_template()

    # ------------------------------------------------------------------------------------------ parsing
    def parse_tool_calls(self, response_ids: list[int], prefix_ids: list[int]) -> tuple[list[ToolCall], bool]:
        """The tool calls in one turn of the model (`response_ids`, its stop token included) written after
        `prefix_ids` (the prompt and earlier turns) -> (calls, whether the turn's tool-call markup failed to
        parse: then the model is told, as a failed call)."""
        try:
            message = self.tokenizer.parse_response(response_ids, prefix=prefix_ids, tools=self.tools)
        except (ValueError, KeyError, TypeError):  # markup the response template cannot read
            return [], True
        calls = []
        for call in message.get("tool_calls") or []:
            function = call.get("function", call) if isinstance(call, dict) else {}
            calls.append(ToolCall(str(function.get("name")), function.get("arguments", {})))
        return calls, False

    # -------------------------------------------------------------------------------------------- answers
    def answer_ids(self, results: list[ToolResult], max_tokens: int | None = None) -> ToolAnswer:
        """The ids the chat template gives after a turn's stop token for its tool `results`: the tool messages,
        each content cut to `max_tokens` tokens when longer (`cut_text`), then the prompt of the next assistant turn."""
        truncated, messages = 0, []
        for result in results:
            content, cut = result.content, False
            if max_tokens is not None:
                content, cut = cut_text(self.tokenizer, content, max_tokens)
            truncated += cut
            messages.append({"role": "tool", "name": result.name, "content": content})
        return ToolAnswer(self.tokenizer.encode(self._suffix(results, messages), add_special_tokens=False), truncated)

    def _suffix(self, results: list[ToolResult], tool_messages: list[dict]) -> str:
        calls = [{"type": "function", "function": {"name": r.name, "arguments": {}}} for r in results]
        base = [{"role": "user", "content": "."}, {"role": "assistant", "content": "", "tool_calls": calls}]
        before = self._render(base)
        after = self._render(base + tool_messages, add_generation_prompt=True)
        return after[before.rindex(self.stop_text) + len(self.stop_text) :]

    def _render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    # ------------------------------------------------------------------------------------------- checks
    def _check_template(self) -> None:
        """Refuse a chat template that cannot show the tools, the model's calls and the tool answers, or that
        rewrites earlier turns when a later one is added (its tool answers could not be appended as ids)."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(_template_problem("has no chat template"))
        name = self.tools[0]["function"]["name"] if self.tools else "probe_tool"
        call = {"type": "function", "function": {"name": name, "arguments": {"x": _PROBE_ARGUMENT}}}
        user = {"role": "user", "content": "Question?"}
        assistant = {"role": "assistant", "content": "Let me check.", "tool_calls": [call]}
        tool = {"role": "tool", "name": name, "content": "Answer-42"}
        turns = [[user], [user, assistant], [user, assistant, tool], [user, assistant, tool, assistant]]
        rendered = [self._render(turns[0], True), self._render(turns[1])]
        rendered += [self._render(turns[2], True), self._render(turns[3])]
        if self.tools and name not in self._render([user]):
            raise ValueError(_template_problem("does not show the tools (`apply_chat_template(..., tools=...)`)"))
        if _PROBE_ARGUMENT not in rendered[1] or self.stop_text not in rendered[1]:
            raise ValueError(
                _template_problem(f"does not render an assistant's `tool_calls` followed by {self.stop_text!r}")
            )
        if "Answer-42" not in rendered[2]:
            raise ValueError(_template_problem("does not render messages of role 'tool'"))
        for shorter, longer in zip(rendered, rendered[1:]):
            if not longer.startswith(shorter):
                raise ValueError(
                    _template_problem(
                        "is not prefix-preserving: rendering a longer conversation changes the text of earlier "
                        "turns (as templates that drop earlier `<think>` blocks do), so the tokens of a multi-turn "
                        "episode would not be the ones the model saw"
                    )
                )
        calls, failed = self.parse_tool_calls(
            self.tokenizer.encode(rendered[1][len(rendered[0]) :], add_special_tokens=False),
            self.tokenizer.encode(rendered[0], add_special_tokens=False),
        )
        if failed or [c.name for c in calls] != [name]:
            raise ValueError(
                f"The tokenizer's `response_template` does not read back the tool call its chat template writes "
                f"(parsed {calls!r}): make the two agree."
            )


def cut_text(tokenizer, text: str, max_tokens: int) -> tuple[str, bool]:
    """`text` cut to at most `max_tokens` tokens -> (the text, whether it was cut). First to `CHARS_PER_TOKEN` x
    `max_tokens` characters, so a huge answer is never tokenized whole; then by tokens, dropping the last ones
    while they decode to a split character (U+FFFD where `text` has none)."""
    cut = len(text) > CHARS_PER_TOKEN * max_tokens
    text = text[: CHARS_PER_TOKEN * max_tokens]
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text, cut
    count = max_tokens
    kept = tokenizer.decode(ids[:count])
    while count > 0 and kept.endswith("\ufffd") and not text.startswith(kept):
        count -= 1
        kept = tokenizer.decode(ids[:count])
    return kept, True


def _template_problem(what: str) -> str:
    return (
        f"Tools need a chat template that renders tool calls and tool answers; this tokenizer's chat template {what}. "
        "Set `tokenizer.chat_template` to one that does (for example the one of a tool-calling model)."
    )


def has_parsing_api(tokenizer_class) -> bool:
    """Whether the installed transformers gives `tokenizer_class` `parse_response(..., prefix=...)` (5.24 on)."""
    parse = getattr(tokenizer_class, "parse_response", None)
    return parse is not None and "prefix" in inspect.signature(parse).parameters


def check_parsing_api(tokenizer) -> None:
    """Refuse a transformers without the `parse_response(..., prefix=...)` API, or a tokenizer without a
    `response_template` for it, naming what to install or set."""
    if not has_parsing_api(type(tokenizer)):
        raise ImportError(
            f"Tools parse the model's tool calls with `tokenizer.parse_response(..., prefix=...)` and a "
            f"`response_template`, which transformers {transformers.__version__} does not have: install "
            f"transformers>={TESTED_TRANSFORMERS}."
        )
    if getattr(tokenizer, "response_template", None) is None:
        raise ValueError(
            "Tools need the tokenizer to parse tool calls, and it has no `response_template`: set "
            "`tokenizer.response_template` (transformers' response-template dict: `start_anchor` and `fields` "
            "with a `tool_calls` field) to one matching its chat template."
        )

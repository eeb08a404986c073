"""The tokenizer's side of tool use: parsing the tool calls the model wrote, and the token ids of the tool answers.

Token in, token out: the model's own tokens are never decoded and encoded again into the episode. Each turn's
tool answers are appended as the ids the chat template gives for those tool messages: the template is rendered
for a conversation ending with the model's tool calls, and again with the tool messages (and the prompt of the
next assistant turn) after them; the text added after the model's stop token is encoded. This is only right for
a chat template that never rewrites earlier turns within an episode (prefix-preserving), which `ToolChat` checks at
construction, with turns written plainly and with a `<think>` block; a stock template that fails is swapped for
the training-safe copy of it in TRL's registry, with a warning (`templates`). A template shipped with trl_ppo, named
by `tool_chat_template` (`templates.SHIPPED`: "chatml"), replaces the tokenizer's, with its parser.

Tool calls are parsed with transformers' `tokenizer.parse_response(ids, schema, prefix=..., tools=...)` and the
tokenizer's `response_template`, or for a stock model family's template the one of TRL's registry (`templates`)
(the API of transformers 5.24; older releases had a `response_schema` instead, which is not supported: `ToolChat`
names the version). The tokenizer itself is never changed.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import transformers

from . import templates
from .execution import ToolCall, ToolResult

TESTED_TRANSFORMERS = "5.24"
# A token spans at most this many characters in the answers that matter (BPE merges of long runs can exceed it;
# then the character cut is the one that binds, and the answer is still counted as cut).
CHARS_PER_TOKEN = 16
_PROBE_ARGUMENT = "probe-7"  # a string a template renders verbatim, to find the tool call in the rendering
_THINK = "<think>\nProbe reasoning.\n</think>\n\n"  # a thinking model's turn opens with one


@dataclass(frozen=True)
class ToolAnswer:
    """The ids appended after a turn's stop token: the tool messages, and the next assistant turn's prompt."""

    ids: list[int]
    truncated: int  # how many of the tool answers were cut to `max_tool_response_length` tokens


class ToolChat:
    """Parse tool calls from a turn, and render tool answers as ids, with `chat_template` and `response_template`
    (the tokenizer's, or for a stock model family TRL's registry's: `templates`). Refuses (at construction, before
    any compute) a tokenizer that cannot do both, or whose chat template rewrites earlier turns and has no
    training-safe copy. `tools`: the JSON schemas the model is shown (`tools.schemas`). `shipped`: the name of a
    template shipped with trl_ppo to use instead of the tokenizer's (`PPOConfig.tool_chat_template`), or None."""

    def __init__(self, tokenizer, tools: list[dict], stop_token_id: int | None, shipped: str | None = None) -> None:
        self.tokenizer, self.tools, self.stop_token_id = tokenizer, tools, stop_token_id
        check_parsing_api(tokenizer)
        if stop_token_id is None:
            raise ValueError(
                "Tools need a stop token that ends each turn of the model, and none is set: set `stop_token='eos'` "
                "(or `stop_token_id`) in the config. A turn without one cannot be told from one cut by the budget."
            )
        self.stop_text = tokenizer.decode([stop_token_id])
        if shipped is not None:  # no swap, no lookup: the named template and its parser, or a refusal
            self.chat_template, self.response_template = templates.shipped_templates(shipped, tokenizer)
            source = f"`tool_chat_template={shipped!r}`"
            try:
                probes = self._check_template(self.chat_template)
            except TemplateProblem as problem:  # with this tokenizer's markup or stop token: say which template
                raise ValueError(f"Tools with {source}: the template shipped under that name {problem.what}.") from None
            self._check_parsing(probes, source)
            return
        self.chat_template, probes = self._usable_chat_template()
        self.response_template, source = templates.response_template(tokenizer)
        if self.response_template is None:
            raise ValueError(
                "Tools need the tokenizer to parse tool calls, and it has no `response_template`: set "
                "`tokenizer.response_template` (transformers' response-template dict: `start_anchor` and `fields` "
                f"with a `tool_calls` field) to one matching its chat template ({source})."
            )
        self._check_parsing(probes, source)

    # ------------------------------------------------------------------------------------------ parsing
    def parse_tool_calls(self, response_ids: list[int], prefix_ids: list[int]) -> tuple[list[ToolCall], bool]:
        """The tool calls in one turn of the model (`response_ids`, its stop token included) written after
        `prefix_ids` (the prompt and earlier turns) -> (calls, whether the turn's tool-call markup failed to
        parse: then the model is told, as a failed call)."""
        try:
            message = self.tokenizer.parse_response(
                response_ids, self.response_template, prefix=prefix_ids, tools=self.tools
            )
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

    def _render(self, messages: list[dict], add_generation_prompt: bool = False, template: str | None = None) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=self.tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=template or self.chat_template,
        )

    # ------------------------------------------------------------------------------------------- checks
    def _usable_chat_template(self) -> tuple[str, list[str]]:
        """(the tokenizer's chat template when it passes `_check_template`, else the training-safe copy of it from
        TRL's registry when there is one that passes (with a warning); the probe's renderings with it). Else the
        refusal of the tokenizer's own."""
        own = getattr(self.tokenizer, "chat_template", None)
        if own is None:
            raise TemplateProblem("has no chat template", templates.chatml_note(self.tokenizer))
        try:
            return own, self._check_template(own)
        except TemplateProblem as problem:
            safe, note = templates.training_chat_template(self.tokenizer)
            if safe is not None and safe != own:
                try:
                    probes = self._check_template(safe)
                except TemplateProblem as also:
                    note = f" The training-safe copy of it in TRL's registry {also.what}, too."
                else:
                    templates.swapped_warning(problem.what)
                    return safe, probes
            raise TemplateProblem(problem.what, note + templates.chatml_note(self.tokenizer)) from None

    def _check_template(self, template: str) -> list[str]:
        """Refuse a chat template that cannot show the tools, the model's calls and the tool answers, or that
        rewrites earlier turns when a later one is added (its tool answers could not be appended as ids). Probed
        with the model's turns written plainly (unless the generation prompt opens a `<think>` block: the turn will
        close it), and with a `<think>` block (templates that drop earlier ones pass the first; unless the
        generation prompt already closes one: thinking turned off)."""
        plain, generation_prompt = self._probe_render(template, "")
        if self.tools and self.tools[0]["function"]["name"] not in plain[0]:
            raise TemplateProblem("does not show the tools (`apply_chat_template(..., tools=...)`)")
        thinks = "<think>" in generation_prompt and "</think>" not in generation_prompt  # the model's turn thinks
        rendered = [] if thinks else [plain]  # ... so a plain turn is not one it can write
        if "</think>" not in generation_prompt:  # unless thinking is turned off
            rendered.append(self._probe_render(template, _THINK)[0])
        for texts in rendered:
            turn = texts[1][len(texts[0]) :]
            if _PROBE_ARGUMENT not in turn or self.stop_text not in turn:
                raise TemplateProblem(
                    f"does not render an assistant's `tool_calls` followed by the stop token {self.stop_text!r} (a "
                    "turn that calls a tool must end with it: where the template ends one with another token, as "
                    "gpt-oss's `<|call|>`, set `stop_token_id` to that token)"
                )
            if "Answer-420" not in texts[2]:
                raise TemplateProblem("does not render messages of role 'tool'")
            if any(not longer.startswith(shorter) for shorter, longer in zip(texts, texts[1:])):
                raise TemplateProblem(
                    "is not prefix-preserving: rendering a longer conversation changes the text of earlier turns (as "
                    "templates that drop earlier `<think>` blocks do), so the tokens of a multi-turn episode would not "
                    "be the ones the model saw"
                )
        return rendered[0]

    def _probe_render(self, template: str, thought: str) -> tuple[list[str], str]:
        """(the renderings of a probe episode, one per step: the prompt, a turn calling a tool, its answer and the
        next prompt, a second such turn and answer; the text the generation prompt adds). The final answer is left
        out: an episode appends nothing after it, so a template may rewrite earlier turns then (gpt-oss drops their
        analysis)."""
        name = self.tools[0]["function"]["name"] if self.tools else "probe_tool"
        messages, texts = [{"role": "user", "content": "Question?"}], []
        try:
            texts.append(self._render(messages, True, template))
            generation_prompt = texts[0][len(self._render(messages, False, template)) :]
            for step, content in enumerate(("Let me check.", "Once more.")):
                call = {"type": "function", "function": {"name": name, "arguments": {"x": f"{_PROBE_ARGUMENT}{step}"}}}
                messages.append({"role": "assistant", "content": thought + content, "tool_calls": [call]})
                texts.append(self._render(messages, False, template))
                messages.append({"role": "tool", "name": name, "content": f"Answer-42{step}"})
                texts.append(self._render(messages, True, template))
        except Exception as error:  # jinja's TemplateError, or a template that cannot take dict arguments
            raise TemplateProblem(f"cannot render a conversation with tool calls ({type(error).__name__}: {error})")
        return texts, generation_prompt

    def _check_parsing(self, texts: list[str], source: str) -> None:
        """Refuse a `response_template` that does not read back the tool calls the chat template writes, in the
        first turn and in one after a tool answer."""
        name = self.tools[0]["function"]["name"] if self.tools else "probe_tool"
        for before, after in ((texts[0], texts[1]), (texts[2], texts[3])):
            calls, failed = self.parse_tool_calls(
                self.tokenizer.encode(after[len(before) :], add_special_tokens=False),
                self.tokenizer.encode(before, add_special_tokens=False),
            )
            if failed or [c.name for c in calls] != [name]:
                raise ValueError(
                    f"The tool-call parser ({source}) does not read back the tool call the chat template writes "
                    f"(parsed {calls!r}): make the two agree."
                )


class TemplateProblem(ValueError):
    """A chat template that cannot be used with tools: `what` it does wrong, and a `note` on what may fix it."""

    def __init__(self, what: str, note: str = "") -> None:
        self.what = what
        super().__init__(
            f"Tools need a chat template that renders tool calls and tool answers; this tokenizer's chat template "
            f"{what}. Set `tokenizer.chat_template` to one that does (for example the one of a tool-calling model)."
            f"{note}"
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



def has_parsing_api(tokenizer_class) -> bool:
    """Whether the installed transformers gives `tokenizer_class` `parse_response(..., prefix=...)` (5.24 on)."""
    parse = getattr(tokenizer_class, "parse_response", None)
    return parse is not None and "prefix" in inspect.signature(parse).parameters


def check_parsing_api(tokenizer) -> None:
    """Refuse a transformers without the `parse_response(..., prefix=...)` API, naming the version to install."""
    if not has_parsing_api(type(tokenizer)):
        raise ImportError(
            f"Tools parse the model's tool calls with `tokenizer.parse_response(..., prefix=...)` and a "
            f"`response_template`, which transformers {transformers.__version__} does not have: install "
            f"transformers>={TESTED_TRANSFORMERS}."
        )

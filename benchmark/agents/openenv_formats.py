"""How the shipped OpenEnv environments read to a model in benchmark/agents/openenv_learn.py: the compact chat
formats of the tiny model (one byte per role, a tool call in a few tokens), and a pretrained ChatML model's own
format (SmolLM2-135M-Instruct with the tool template shipped with trl_ppo, the observations as the adapter renders
them by default)."""

from __future__ import annotations

import re

# ------------------------------------------------------------------------------------------- the compact format
# Roles `s` (the tools' line), `u`, `a`, `o` (a tool's answer), as benchmark/credit/tasks.py; CALL writes one call. Its
# arguments must show: trl_ppo's ToolChat probes the template with a call `{"x": "probe-70"}` and parses it back.
FRAME = (
    "{% if tools %}<|im_start|>s{% for tool in tools %} {{ tool.function.name }}{% endfor %}<|im_end|>{% endif %}"
    "{% for message in messages %}{% if message.role == 'assistant' %}<|im_start|>a{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}CALL{% endfor %}<|im_end|>"
    "{% else %}<|im_start|>{{ 'o' if message.role == 'tool' else 'u' }}{{ message.content }}<|im_end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>a{% endif %}"
)
ARGUMENTS = "{% for key, value in (call.function.arguments or {}).items() %}"
CALLS = {"guess": ARGUMENTS + "{{ value }}{% endfor %}",  # "3"
         "arithmetic": "{{ call.function.name }}" + ARGUMENTS + " {{ key }}={{ value }}{% endfor %}"}  # "add a=1 b=2"


def response_template(env: str, names: list[str]) -> dict:
    """transformers' response-template dict. guess: the turn's last word is `guess`'s number (made an integer by the
    tool's schema); arithmetic: a tool's name, then ` key=value` pairs (transformers' kv-lines parser)."""
    if env == "guess":
        calls = {"open_pattern": r"(?P<number>[^\s.<>]+)(?=<\|im_end\|>)", "content": "text",
                 "transform": {"type": "function", "function": {"name": "guess", "arguments": {"number": "{number}"}}}}
    else:
        calls = {"open_pattern": "(?P<name>" + "|".join(map(re.escape, names)) + ")", "content": "kv-lines",
                 "content_args": {"line_sep": " ", "kv_sep": "="},
                 "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}}
    return {"defaults": {"role": "assistant"}, "start_anchor": "<|im_start|>a",
            "fields": {"tool_calls": {"close": "<|im_end|>", "repeats": True, **calls},
                       "content": {"close_pattern": r"<\|im_end\|>", "content": "text"}}}


def build_tokenizer(env: str, names: list[str]):
    """trl_ppo.agents.tiny_chat's byte-level tokenizer in the compact format of `env` for the tools `names`;
    arithmetic's tool names are one token each (choosing a tool is one token)."""
    from trl_ppo.agents.tiny_chat import SPECIAL, build_byte_tokenizer

    tokenizer = build_byte_tokenizer(SPECIAL, eos_token=SPECIAL[2], pad_token=SPECIAL[0])
    if env == "arithmetic":
        tokenizer.add_tokens(sorted(names))
    tokenizer.chat_template = FRAME.replace("CALL", CALLS[env])
    tokenizer.response_template = response_template(env, names)
    return tokenizer


def render_guess(observation: dict) -> str:
    """The server's answer, one word; its opening text ("Find my number ...") is left out: the prompt says it."""
    feedback = observation.get("feedback", "")
    return feedback if feedback in ("higher", "lower", "correct") else ""


def render_arithmetic(observation: dict) -> str:
    """The question as "3*4+5" (the numbers at the same places in every prompt)."""
    question = (observation.get("metadata") or {}).get("question", "")
    found = re.search(r"What is \((\d+) \* (\d+)\) \+ (\d+)\?", question)
    return "{}*{}+{}".format(*found.groups()) if found else question


# ------------------------------------------------------------------------------------------- a chat model's format
def chat_tokenizer(model: str):
    """The tokenizer of the pretrained ChatML model in the folder `model`, with the tool template shipped with trl_ppo
    and its parser (`tool_chat_template="chatml"`), left-padded as the trainer samples."""
    from transformers import AutoTokenizer

    from trl_ppo.agents.templates import shipped_templates

    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
    tokenizer.chat_template, tokenizer.response_template = shipped_templates("chatml", tokenizer)
    return tokenizer

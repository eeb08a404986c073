"""A tiny tool-calling tokenizer built offline: byte-level (any text, JSON included, encodes and decodes back
exactly), with a Qwen/Hermes-style chat template (`<tool_call>{json}</tool_call>` in assistant turns, tool answers
as `<tool_response>` blocks in a user turn) and the `response_template` that parses it. For tests, examples and
benchmarks on tiny models; a real model brings its own. `build_byte_tokenizer`: the same bytes with a model family's
markup tokens, to try that family's own chat template offline."""

from __future__ import annotations

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Newlines are written as `{{ "\n" }}`: transformers renders with `trim_blocks`, which eats one after a tag.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system{{ '\\n' }}Tools:{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}"
    "{% endfor %}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>{{ '\\n' }}{{ message.content }}{{ '\\n' }}</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant{{ '\\n' }}{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}<tool_call>"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "</tool_call>{% endfor %}<|im_end|>{{ '\\n' }}"
    "{% else %}<|im_start|>{{ message.role }}{{ '\\n' }}{{ message.content }}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)

RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r"\s*<tool_call>",
            "close": "</tool_call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"\s*<\|im_end\|>", "content": "text"},
    },
}


def build_tool_tokenizer():
    """A `PreTrainedTokenizerFast` of the 256 bytes and `SPECIAL` (pad `<|endoftext|>`, eos `<|im_end|>`), left
    padding, with `CHAT_TEMPLATE` and `RESPONSE_TEMPLATE`."""
    tokenizer = build_byte_tokenizer(SPECIAL, eos_token=SPECIAL[2], pad_token=SPECIAL[0])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer


def build_byte_tokenizer(special_tokens: list[str], eos_token: str, pad_token: str | None = None, bos_token=None):
    """A `PreTrainedTokenizerFast` of the 256 bytes (any text encodes and decodes back exactly) and
    `special_tokens` (one id each: a model family's markup tokens), left padding, no chat template: offline
    stand-ins for the tokenizers of real model families."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, padding_side="left", pad_token=pad_token or eos_token, eos_token=eos_token,
        bos_token=bos_token,
    )
    named = (pad_token, eos_token, bos_token)
    tokenizer.add_special_tokens({"additional_special_tokens": [t for t in special_tokens if t not in named]})
    return tokenizer

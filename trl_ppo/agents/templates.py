"""Stock model families without a hand-written parser: the parser of the model's tool calls (`response_template`)
and, where a family's own chat template rewrites earlier turns, a training-safe template, both looked up in TRL's
registry `trl.chat_template_utils`.

The choice, and why:
- TRL's registry (`add_response_schema`, `get_training_chat_template`) knows the stock chat templates of Qwen2.5,
  Qwen3 (with Instruct-2507, Qwen3-VL, Qwen3.5 thinking and non-thinking, 3.6, 3.8), Llama 3.1 / 3.2, gpt-oss,
  GLM-4-MoE, Nemotron 3, LFM2.5 and Gemma 4, and keeps a training-safe (prefix-preserving) copy of those that rewrite
  earlier turns (stock Qwen3). It is maintained with TRL GRPO, which relies on it for the same job, Apache-2.0, on
  PyPI. Templates of our own would be a second registry to keep in step with every new checkpoint.
- transformers' own mechanism is a `response_template` shipped in a checkpoint's tokenizer files: used first, always
  (a tokenizer with one needs nothing here). transformers 5.24 also has a fallback table keyed by `model_type`, but it
  is private to its serving CLI (`transformers.cli.serving.utils`), covers Qwen2/3/3.5 and Gemma 4 only, and has no
  training-safe templates: not something to build on.
- So TRL is an optional extra, `pip install 'trl_ppo[templates]'` (trl>=1.12,<1.13, the range tested here: the
  registry matches templates by their exact text and its API is young). It adds trl alone: its own requirements
  (accelerate, datasets, jinja2, transformers) are trl_ppo's already. It is imported lazily, only when a tokenizer
  brings no `response_template`, or its chat template fails the checks of `chat.ToolChat`; a missing extra is named
  in the refusal.

A ChatML model whose own template has no tool section (SmolLM2) is given one shipped with trl_ppo by name
(`PPOConfig.tool_chat_template="chatml"`, `shipped_templates`): `chatml_tools.jinja`, laid out as Qwen2.5's, whose
parser is the registry's for Qwen2.5 (the call format is the same, so no parser is written here).

The user's tokenizer is never changed: the parser and the template in use are held by `ToolChat` and passed to
`parse_response(schema=...)` and `apply_chat_template(chat_template=...)`, so a saved tokenizer keeps its own.
"""

from __future__ import annotations

import copy
from importlib import resources

from transformers.utils import logging

logger = logging.get_logger(__name__)

TESTED_TRL = "trl>=1.12,<1.13"
INSTALL = f"pip install 'trl_ppo[templates]'` ({TESTED_TRL})"

# `tool_chat_template` names: (the template file shipped in this package, the markup tokens a tokenizer needs for it,
# the registry's stock template whose parser reads its calls).
SHIPPED = {"chatml": ("chatml_tools.jinja", ("<|im_start|>", "<|im_end|>"), "qwen2_5_chat_template")}


def registry():
    """TRL's `chat_template_utils`, or None when the `templates` extra is not installed (or a trl without it)."""
    try:
        import trl.chat_template_utils as registry
    except ImportError:
        return None
    has_api = all(hasattr(registry, name) for name in ("add_response_schema", "get_training_chat_template"))
    return registry if has_api else None


def response_template(tokenizer) -> tuple[dict | None, str]:
    """(the parser of the model's tool calls, where it came from): the tokenizer's own `response_template`, else
    the registry's for its stock chat template; (None, why not) when neither has one."""
    own = getattr(tokenizer, "response_template", None)
    if own is not None:
        return own, "the tokenizer's `response_template`"
    known = registry()
    if known is None:
        return None, f"for a stock model family (Qwen2.5, Qwen3, Llama 3.1/3.2, gpt-oss, ...), `{INSTALL} sets it"
    try:
        found = known.add_response_schema(_stock_copy(known, tokenizer)).response_template
    except (ValueError, AttributeError):
        return None, "TRL's registry of stock chat templates does not know this one"
    return found, "TRL's registry (`add_response_schema`)"


def training_chat_template(tokenizer) -> tuple[str | None, str]:
    """(the registry's training-safe template for the tokenizer's stock chat template, or None; a note for a
    refusal when None)."""
    known = registry()
    if known is None:
        return None, f" For a stock model family, `{INSTALL} swaps in a training-safe template."
    from jinja2 import TemplateError  # trl's requirement (transformers renders templates with it, not requiring it)

    try:
        safe = known.get_training_chat_template(_stock_copy(known, tokenizer))
    except (ValueError, TypeError, TemplateError):  # an unknown template, or one its own probes cannot render
        safe = None
    if safe is None:
        return None, " TRL's registry has no training-safe copy of this chat template."
    return safe, ""


def swapped_warning(why: str) -> None:
    logger.warning(
        f"The tokenizer's chat template {why}; tools use the training-safe copy of it from TRL's registry "
        "(`get_training_chat_template`) instead. The tokenizer itself is left as it is."
    )


def _stock_copy(known, tokenizer):
    """A shallow copy of `tokenizer` (the user's is left alone: the registry sets attributes on what it is given)
    whose chat template is the registry's own text of it, matched ignoring surrounding whitespace (which a
    checkpoint's files or a GGUF header may add or drop; the registry's training-safe copy of a template counts as
    that template), and with no parser set."""
    stock = copy.copy(tokenizer)
    stock.response_template = None
    text = tokenizer.chat_template
    if isinstance(text, str):
        for name in dir(known):
            value = getattr(known, name)
            if name.endswith("_chat_template") and isinstance(value, str) and value.strip() == text.strip():
                stock.chat_template = getattr(known, name.replace("_training_chat_template", "_chat_template"), value)
                break
    return stock


def shipped_templates(name: str, tokenizer) -> tuple[str, dict]:
    """(the chat template shipped under `name`, the registry's parser for it). Refuses, before any compute, an unknown
    name, a tokenizer without the template's markup tokens (each one token), and a missing `templates` extra."""
    if name not in SHIPPED:
        raise ValueError(f"Unknown `tool_chat_template` {name!r}: use one of {sorted(SHIPPED)} (or None).")
    filename, markup, stock = SHIPPED[name]
    missing = [token for token in markup if not is_one_token(tokenizer, token)]
    if missing:
        raise ValueError(
            f"`tool_chat_template={name!r}` needs a tokenizer with the markup tokens {list(markup)}, each a single "
            f"token; this one lacks {missing}, so it is not a {name} model. Leave `tool_chat_template` unset and give "
            "the tokenizer a `chat_template` and `response_template` of its own family."
        )
    known = registry()
    if known is None:
        raise ValueError(f"`tool_chat_template={name!r}` reads tool calls with TRL's registry: `{INSTALL}.")
    stock_like = copy.copy(tokenizer)  # the registry sets the parser on what it is given: never the user's
    stock_like.response_template, stock_like.chat_template = None, getattr(known, stock)
    parser = known.add_response_schema(stock_like).response_template
    return shipped_template_text(name), parser


def shipped_template_text(name: str) -> str:
    """The text of the chat template shipped under `name` (a key of `SHIPPED`)."""
    return resources.files(__package__).joinpath(SHIPPED[name][0]).read_text(encoding="utf-8")


def is_one_token(tokenizer, token: str) -> bool:
    """Whether `token` is in the tokenizer's vocabulary and encodes to that one id (not split into pieces)."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    return token_id is not None and token_id != tokenizer.unk_token_id and tokenizer.encode(
        token, add_special_tokens=False
    ) == [token_id]


def chatml_note(tokenizer) -> str:
    """A hint for a refusal: for a ChatML tokenizer whose chat template knows nothing of tools, the option that gives
    it the shipped tool template (a template with tools of its own is refused for other reasons)."""
    own = getattr(tokenizer, "chat_template", None)
    if "tool" in (own if isinstance(own, str) else "").lower():
        return ""
    if all(is_one_token(tokenizer, token) for token in SHIPPED["chatml"][1]):
        return (
            " This tokenizer speaks ChatML: `tool_chat_template='chatml'` in the config gives it the tool template "
            "shipped with trl_ppo (Qwen2.5's layout)."
        )
    return ""

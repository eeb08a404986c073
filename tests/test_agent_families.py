"""Stock model families without a hand-written parser (issue 34, part 2): each family's own chat template (TRL's
copy of it, `trl.chat_template_utils`), on an offline byte-level tokenizer with the family's markup tokens and no
`response_template`. A scripted tool call written as the template writes it is parsed, run and answered."""

import copy
import logging
import os
import sys
from types import SimpleNamespace

import pytest
from conftest import needs_tool_parsing

from trl_ppo.agents.chat import ToolChat
from trl_ppo.agents.tiny_chat import build_byte_tokenizer
from trl_ppo.agents.tools import schemas, toolbox
from trl_ppo.rollout.turn_loop import Episode, run_turns

registry = pytest.importorskip("trl.chat_template_utils", reason="the `templates` extra (trl) is not installed")
pytestmark = needs_tool_parsing

CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3 = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
          "<|python_tag|>"]
HARMONY = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"]
DEEPSEEK = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁outputs▁begin｜>",
            "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<｜tool▁sep｜>"]
GEMMA4 = ["<bos>", "<eos>", "<|turn>", "<turn|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
          "<tool_response|>", '<|"|>', "<|channel>", "<channel|>", "<|tool>", "<tool|>", "<|think|>"]

# family (the name of its stock template in TRL's registry): its markup tokens, the token ending a turn of the
# model (the stop token: `stop_token_id` in the config; the checkpoint's EOS but for gpt-oss and Gemma 4), BOS.
FAMILIES = {
    "qwen2_5": (CHATML, "<|im_end|>", None),
    "qwen3": (CHATML, "<|im_end|>", None),
    "qwen3_instruct_2507": (CHATML, "<|im_end|>", None),
    "qwen3_5_think": (CHATML, "<|im_end|>", None),
    "qwen3_5_nothink": (CHATML, "<|im_end|>", None),
    "qwen3_6": (CHATML, "<|im_end|>", None),
    "qwen3_8": (CHATML, "<|im_end|>", None),
    "llama3_1": (LLAMA3, "<|eot_id|>", "<|begin_of_text|>"),
    "llama3_2": (LLAMA3, "<|eot_id|>", "<|begin_of_text|>"),
    "gptoss": (HARMONY, "<|call|>", None),  # its EOS `<|return|>` ends a final answer; a tool call ends `<|call|>`
    "nemotron_3_nano": (CHATML, "<|im_end|>", None),
    "lfm2_2_5": (CHATML + ["<|tool_call_start|>", "<|tool_call_end|>"], "<|im_end|>", "<|startoftext|>"),
    # Gemma 4 ends a turn that calls a tool with `<|tool_response>` (a final answer with `<turn|>`, its EOS)
    "gemma4": (GEMMA4, "<|tool_response>", "<bos>"),
    "gemma3": (["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<end_of_turn>", "<bos>"),
    "phi3_5": (["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"], "<|end|>", None),
    "deepseekv3": (DEEPSEEK, "<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>"),
}
SWAPPED = {"qwen3"}  # stock templates that rewrite earlier turns: the registry's training-safe copy is used
# Families whose stock template cannot carry tools here, and why (the refusal says so, naming what to set).
REFUSED = {
    "gemma3": "cannot render a conversation with tool calls",  # no tool role, no tool calls
    "phi3_5": "does not show the tools",  # nor tool calls, nor tool messages
    # writes the text of a turn that calls a tool after the tool's answer: such a turn cannot be answered as ids
    "gemma4": "is not prefix-preserving",
    # string arguments only; its training-safe copy takes dicts but, like it, never lists the tools to the model
    "deepseekv3": "cannot render a conversation with tool calls.*copy of it in TRL's registry does not show the tools",
}


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


TOOLS = toolbox([multiply])


def family_tokenizer(family: str):
    special, stop, bos = FAMILIES[family]
    tokenizer = build_byte_tokenizer(special, eos_token=stop, bos_token=bos)
    tokenizer.chat_template = getattr(registry, f"{family}_chat_template")
    return tokenizer


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in REFUSED])
def test_a_stock_familys_tool_call_is_parsed_run_and_answered_with_no_parser_set(family, caplog):
    tokenizer = family_tokenizer(family)
    stock = tokenizer.chat_template
    with caplog.at_level(logging.WARNING):
        chat = ToolChat(tokenizer, schemas(TOOLS), tokenizer.eos_token_id)
    assert (chat.chat_template != stock) == (family in SWAPPED)
    assert ("training-safe copy" in caplog.text) == (family in SWAPPED)
    assert tokenizer.chat_template == stock and getattr(tokenizer, "response_template", None) is None  # untouched

    def render(messages, **kwargs):
        text = tokenizer.apply_chat_template(
            messages, tools=schemas(TOOLS), tokenize=False, chat_template=chat.chat_template, **kwargs
        )
        return tokenizer.encode(text, add_special_tokens=False)

    user = {"role": "user", "content": "What is 6 times 7?"}
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}}
    prompt = render([user], add_generation_prompt=True)
    opened = tokenizer.decode(prompt[len(render([user])) :])  # what the generation prompt writes
    thinking = "<think>" in opened and "</think>" not in opened  # the model's turn goes on thinking
    thought = "<think>\nMultiply.\n</think>\n\n" if thinking else ""
    calling = {"role": "assistant", "content": thought, "tool_calls": [call]}
    written = render([user, calling])[len(prompt) :]  # the call as the family's template writes it
    turn = written[: written.index(tokenizer.eos_token_id) + 1]  # the model stops at its stop token
    final = tokenizer.encode("It is 42.", add_special_tokens=False) + [tokenizer.eos_token_id]
    turns = [turn, final]
    played = run_turns([Episode(prompt, TOOLS)], lambda contexts, n: [turns.pop(0)], chat, max_turns=3, budget=600)
    episode = played[0]
    assert episode.tool_calls == 1 and episode.tool_errors == 0 and episode.turns == 2 and not episode.truncated
    answer = {"role": "tool", "name": "multiply", "content": "42"}
    answered = render([user, calling, answer], add_generation_prompt=True)
    assert episode.context == answered + final  # token in, token out: the family's own rendering, ids for ids
    assert episode.model_mask == [True] * len(turn) + [False] * (len(answered) - len(prompt) - len(turn)) + [
        True
    ] * len(final)


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_a_stock_family_that_cannot_carry_tools_is_refused_saying_why(family):
    tokenizer = family_tokenizer(family)
    with pytest.raises(ValueError, match=REFUSED[family]):
        ToolChat(tokenizer, schemas(TOOLS), tokenizer.eos_token_id)


def test_a_stop_token_that_does_not_end_a_tool_calling_turn_is_refused_naming_the_one_to_set():
    """gpt-oss's EOS `<|return|>` ends a final answer; a turn that calls a tool ends with `<|call|>`."""
    tokenizer = family_tokenizer("gptoss")
    with pytest.raises(ValueError, match=r"followed by the stop token '<\|return\|>'.*set `stop_token_id`"):
        ToolChat(tokenizer, schemas(TOOLS), tokenizer.convert_tokens_to_ids("<|return|>"))


def test_without_the_templates_extra_the_refusal_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl.chat_template_utils", None)  # as if trl were not installed
    tokenizer = family_tokenizer("qwen2_5")
    with pytest.raises(ValueError, match=r"has no `response_template`.*pip install 'trl_ppo\[templates\]'"):
        ToolChat(tokenizer, schemas(TOOLS), tokenizer.eos_token_id)
    tokenizer = family_tokenizer("qwen3")
    with pytest.raises(ValueError, match=r"not prefix-preserving.*pip install 'trl_ppo\[templates\]'"):
        ToolChat(tokenizer, schemas(TOOLS), tokenizer.eos_token_id)


def test_a_template_the_registry_does_not_know_keeps_the_refusal_naming_what_to_set():
    tokenizer = family_tokenizer("qwen2_5")
    tokenizer.chat_template = tokenizer.chat_template.replace("You are Qwen", "You are a bot")
    with pytest.raises(ValueError, match="set `tokenizer.response_template`.*registry .*does not know this one"):
        ToolChat(tokenizer, schemas(TOOLS), tokenizer.eos_token_id)
    tokenizer.response_template = copy.deepcopy(registry.qwen3_template)  # the user's own parser is used
    assert ToolChat(tokenizer, schemas(TOOLS), tokenizer.eos_token_id).response_template == registry.qwen3_template


def test_a_stock_template_is_known_with_other_surrounding_whitespace_and_as_its_training_copy():
    """A checkpoint's files or a GGUF header may end the template with a newline; a user may have set the
    registry's training-safe copy already: the parser is found for both, and nothing is swapped."""
    tokenizer = family_tokenizer("qwen2_5")
    tokenizer.chat_template += "\n"
    assert ToolChat(tokenizer, schemas(TOOLS), tokenizer.eos_token_id).response_template == registry.qwen3_template
    tokenizer = family_tokenizer("qwen3")
    tokenizer.chat_template = registry.qwen3_training_chat_template
    chat = ToolChat(tokenizer, schemas(TOOLS), tokenizer.eos_token_id)
    assert chat.chat_template == registry.qwen3_training_chat_template
    assert chat.response_template == registry.qwen3_template


def test_episode_prompts_are_rendered_with_the_swapped_in_template():
    """Stock Qwen3 drops the empty `<think>` block of an assistant turn before the last question; its
    training-safe copy keeps it. A chat prompt with such a turn starts its episode as the copy renders it."""
    import torch

    from trl_ppo.agents.runner import AgentRunner

    tokenizer = family_tokenizer("qwen3")
    args = SimpleNamespace(max_turns=3, max_tool_response_length=None, max_prompt_length=None, response_length=64)
    runner = AgentRunner(args, tokenizer, [multiply], None, tokenizer.eos_token_id, ["prompt"])
    prompt = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
              {"role": "user", "content": "What is 6 times 7?"}]
    ids = torch.tensor([tokenizer.encode("x", add_special_tokens=False)])  # replaced by the rendering of `prompt`
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "prompt": [prompt]}
    query = runner.start_episodes(batch, args, context=None)[0].query

    def render(template):
        text = tokenizer.apply_chat_template(
            prompt, tools=schemas(TOOLS), tokenize=False, add_generation_prompt=True, chat_template=template
        )
        return tokenizer.encode(text, add_special_tokens=False)

    assert render(registry.qwen3_training_chat_template) != render(registry.qwen3_chat_template)
    assert query == render(registry.qwen3_training_chat_template)


@pytest.mark.skipif(not os.environ.get("TRL_PPO_QWEN_CODER"), reason="set TRL_PPO_QWEN_CODER to the converted folder")
def test_the_real_qwen2_5_coder_tokenizer_needs_no_parser_set():
    """Qwen2.5-Coder-0.5B-Instruct (`make demo-agent-qwen` fetches it; TRL_PPO_QWEN_CODER: its converted folder) ships
    Qwen2.5's template and no `response_template`: its Hermes `<tool_call>` is parsed, run and answered."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.environ["TRL_PPO_QWEN_CODER"])
    assert getattr(tokenizer, "response_template", None) is None
    chat = ToolChat(tokenizer, schemas(TOOLS), tokenizer.eos_token_id)
    messages = [{"role": "user", "content": "What is 6 times 7?"}]
    prompt = tokenizer.apply_chat_template(messages, tools=schemas(TOOLS), add_generation_prompt=True, tokenize=False)
    written = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call><|im_end|>'
    turns = [tokenizer.encode(written, add_special_tokens=False), tokenizer.encode("42<|im_end|>")]
    query = tokenizer.encode(prompt, add_special_tokens=False)
    episode = run_turns([Episode(query, TOOLS)], lambda contexts, n: [turns.pop(0)], chat, max_turns=3, budget=200)[0]
    assert episode.tool_calls == 1 and episode.tool_errors == 0 and episode.turns == 2
    assert "<tool_response>\n42\n</tool_response>" in tokenizer.decode(episode.response)


def test_a_trainer_with_stock_qwen3_and_no_parser_set_plays_and_learns_from_tool_calls(
    make_config, caplog, monkeypatch
):
    """`PPOTrainer(tools=...)` with stock Qwen3's template and no `response_template`: the parser and the
    training-safe template come from the registry, the calls are parsed, run and answered, and the run updates."""
    from conftest import script_tool_turns, scripted_tool_trainer, train_and_check_one_call_per_episode

    tokenizer = family_tokenizer("qwen3")
    final = "<think>\n\n</think>\n\nIt is 42.<|im_end|>"
    script_tool_turns(monkeypatch, tokenizer, final)
    with caplog.at_level(logging.WARNING):
        trainer = scripted_tool_trainer(make_config, tokenizer, [multiply])
    assert "training-safe copy" in caplog.text
    train_and_check_one_call_per_episode(trainer)

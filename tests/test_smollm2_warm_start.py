"""The warm start's data generator and script (examples/scripts/smollm2_tool_warm_start.py, issue 43 part 2): the
held-out "(a * b) + c" problems, the one-operation transcripts rendered with the shipped ChatML tool template and
labelled on the model's turns only, and a two-step warm start of a tiny model, cached. SmolLM2 itself is not
trained here."""

import os
import random

import pytest
import torch
from conftest import load_example_script, needs_tool_parsing, tiny_config

from trl_ppo.agents.tiny_chat import build_byte_tokenizer

pytest.importorskip("trl.chat_template_utils", reason="the `templates` extra (trl) is not installed")
pytestmark = needs_tool_parsing
warm = load_example_script("smollm2_tool_warm_start")


def chatml_tokenizer():
    return build_byte_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos_token="<|im_end|>",
                                pad_token="<|endoftext|>")


def test_held_out_problems_are_100_never_in_training_and_need_two_operations():
    held_out, training = warm.split_problems()
    assert len(held_out) == 100 and len(training) > 1000 and not set(held_out) & set(training)
    assert warm.split_problems() == (held_out, training)  # fixed by the seed
    a, b, c = held_out[0]
    assert warm.answer(a, b, c) == warm.add(warm.multiply(a, b), c) and str(c) in warm.question(a, b, c)


def test_a_transcript_calls_one_tool_and_copies_its_answer():
    for seed in range(20):
        user, calling, tool, final = warm.one_operation_conversation(random.Random(seed))
        function = calling["tool_calls"][0]["function"]
        result = getattr(warm, function["name"])(**function["arguments"])
        assert tool["content"] == str(result) and final["content"] == f"The answer is {result}."
        assert "(" not in user["content"]  # one operation: never the held-out task's form


def test_examples_render_with_the_shipped_template_and_train_on_the_models_turns_only():
    tokenizer = chatml_tokenizer()
    own = tokenizer.chat_template
    ids, labels = warm.warm_start_examples(tokenizer, 1, seed=3, chain_rate=0.0)[0]
    assert tokenizer.chat_template == own  # a copy renders
    text = tokenizer.decode(ids)
    assert "# Tools" in text and '"name": "multiply"' in text and "<tool_response>" in text
    trained = tokenizer.decode([i for i, label in zip(ids, labels) if label != -100])
    assert trained.startswith("<tool_call>\n{\"name\": ") and trained.endswith("<|im_end|>")
    assert trained.count("<|im_end|>") == 2 and "<tool_response>" not in trained and "What is" not in trained


def test_a_warm_start_trains_saves_and_is_reused(tmp_path):
    from transformers import AutoModelForCausalLM

    tokenizer = chatml_tokenizer()
    config = tiny_config("qwen2", tokenizer)
    config.max_position_embeddings = 2048
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    folder = warm.warm_start(model, tokenizer, str(tmp_path / "warm"), steps=2, batch_size=2, learning_rate=1e-3)
    assert warm.is_done(folder) and os.path.isfile(os.path.join(folder, "config.json"))
    assert any(not torch.equal(p, before[name]) for name, p in model.named_parameters())
    stamp = os.path.getmtime(os.path.join(folder, warm.DONE_MARKER))
    assert warm.warm_start(None, tokenizer, folder, steps=2) == folder  # cached: nothing trained or written
    assert os.path.getmtime(os.path.join(folder, warm.DONE_MARKER)) == stamp


def test_held_out_episodes_are_played_with_both_tools_and_scored(monkeypatch):
    """The evaluation's wiring, with a scripted model: two calls, then the answer copied from the second."""
    tokenizer = chatml_tokenizer()
    problems = warm.split_problems()[0][:2]
    scripts = {}

    def sampler(model, rendering, temperature, batch_size):
        def sample_turn(contexts, max_new_tokens):
            turns = []
            for context in contexts:
                text = rendering.decode(context)
                a, b, c = next(p for p in problems if warm.question(*p) in text)
                step = text.count("<tool_response>")
                call = [("multiply", a, b), ("add", a * b, c)][step] if step < 2 else None
                written = (f'<tool_call>\n{{"name": "{call[0]}", "arguments": {{"a": {call[1]}, "b": {call[2]}}}}}\n'
                           f"</tool_call><|im_end|>") if call else f"The answer is {a * b + c}.<|im_end|>"
                scripts.setdefault((a, b, c), []).append(written)
                turns.append(rendering.encode(written, add_special_tokens=False))
            return turns

        return sample_turn

    monkeypatch.setattr(warm.agent_task, "model_sampler", sampler)  # the module the script holds (another may be
    # in sys.modules, loaded again by an earlier test)
    result = warm.evaluate(torch.nn.Linear(1, 1), tokenizer, problems, budget=400)
    assert result["success"] == 1.0 and result["tool_call_rate"] == 1.0
    assert all(len(turns) == 3 for turns in scripts.values()) and len(scripts) == 2


def two_call_shapes(shapes, seeds=60):
    seen = set()
    for seed in range(seeds):
        messages = warm.two_operation_conversation(random.Random(seed), shapes)
        calls = [m["tool_calls"][0]["function"] for m in messages if m.get("tool_calls")]
        answers = [m["content"] for m in messages if m["role"] == "tool"]
        first, second = (getattr(warm, call["name"]) for call in calls)
        assert calls[1]["arguments"]["a"] == first(**calls[0]["arguments"])  # chained on the first answer
        assert answers == [str(first(**calls[0]["arguments"])), str(second(**calls[1]["arguments"]))]
        assert messages[-1]["content"] == f"The answer is {answers[1]}."
        seen.add((first, second))
    return seen


def test_two_call_transcripts_chain_the_first_answer_into_the_second_call():
    assert two_call_shapes(warm.CHAIN_SHAPES) == set(warm.CHAIN_SHAPES)
    assert two_call_shapes(warm.OTHER_SHAPES) == set(warm.OTHER_SHAPES)  # never the task's (multiply, add)
    assert (warm.multiply, warm.add) not in warm.OTHER_SHAPES
    tokenizer = chatml_tokenizer()
    examples = warm.warm_start_examples(tokenizer, 40, seed=0, chain_rate=0.5)
    calls = [tokenizer.decode(ids).count("<tool_call>\n{\"name\": \"") for ids, _ in examples]
    assert set(calls) == {1, 2} and 10 < calls.count(2) < 30


def test_task_shaped_transcripts_are_never_held_out_problems(monkeypatch):
    a, b, c = warm.split_problems()[0][0]
    draws = iter([0, a, b, c, 500])  # the shape, then a held-out triple: its c is drawn again

    class Scripted(random.Random):
        def choice(self, seq):
            return seq[next(draws)]

        def randint(self, low, high):
            return next(draws)

    messages = warm.two_operation_conversation(Scripted())
    assert messages[0]["content"] == f"What is ({a} * {b}) + 500?"

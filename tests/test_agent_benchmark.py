"""The calculator-tool benchmark (benchmark/agents/agent_tools.py): its reward (the final turn only, both trainers'
completion forms), its SFT data (the trainers' own prompt, labels on the assistant's turns only), and its small
CPU form as a smoke test (no learning asserted)."""

import json
import os
import random
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, load_example_script, needs_tool_parsing

SCRIPT = os.path.join(REPO_ROOT, "benchmark", "agents", "agent_tools.py")


@pytest.fixture(scope="module")
def task():
    return load_example_script("agent_task", folder="benchmark/agents")


@pytest.fixture(scope="module")
def tool_tokenizer(task):
    return task.build_tokenizer()


def test_reward_reads_the_last_integer_of_the_final_turn_only(task):
    call = '<tool_call>{"name": "multiply", "arguments": {"a": 23, "b": 45}}</tool_call>'
    completions = [
        "The answer is 1035.",
        call + "The answer is 1035.",
        call,  # ended on the call: no final answer
        "1035 is close, the answer is 1036.",  # the last integer counts
        call.replace("23", "1035") + "The answer is 7.",  # the call's arguments are not the answer
        "The answer is 10350.",
    ]
    assert task.product_reward(None, completions, [1035] * 6) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert [task.calls_tool(c) for c in completions] == [False, True, True, False, True, False]
    tool_call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 23, "b": 45}}}
    messages = [  # TRL GRPO's conversational completions
        [{"role": "assistant", "content": "The answer is 1035."}],
        [{"role": "assistant", "content": "", "tool_calls": [tool_call]}, {"role": "tool", "content": "1035"}],
        [{"role": "assistant", "content": "", "tool_calls": [tool_call]}, {"role": "tool", "content": "1035"},
         {"role": "assistant", "content": "The answer is 1035."}],
    ]
    assert task.product_reward(None, messages, [1035] * 3) == [1.0, 0.0, 1.0]
    assert [task.calls_tool(m) for m in messages] == [False, True, True]


def test_sft_prompt_is_the_trainer_prompt_and_labels_are_the_assistant_turns(task, tool_tokenizer):
    from trl_ppo.agents.tools import schemas, toolbox

    tokenizer = tool_tokenizer
    rendered = tokenizer.apply_chat_template(  # as trl_ppo's AgentRunner renders a chat prompt with its tools
        task.prompt_messages(23, 45), tools=schemas(toolbox([task.multiply])), tokenize=False,
        add_generation_prompt=True,
    )
    prompt = task.prompt_ids(tokenizer, 23, 45)
    assert prompt == tokenizer.encode(rendered, add_special_tokens=False)

    rng = random.Random(0)
    conversation = task.sft_conversation(23, 45, rng, tool_rate=1.0)
    ids, labels = task.sft_example(tokenizer, conversation)
    assert ids[: len(prompt)] == prompt and all(label == -100 for label in labels[: len(prompt)])
    full = tokenizer.apply_chat_template(conversation, tools=[task.multiply], tokenize=False)
    assert full.startswith(tokenizer.decode(ids))
    learned = tokenizer.decode([label for label in labels if label != -100])
    assert learned == (
        '<tool_call>{"name": "multiply", "arguments": {"a": 23, "b": 45}}</tool_call><|im_end|>'
        "The answer is 1035.<|im_end|>"
    )
    assert "1035" in tokenizer.decode([i for i, label in zip(ids, labels) if label == -100][len(prompt) :])

    guesses = [task.sft_conversation(23, 45, rng, tool_rate=0.0) for _ in range(50)]
    assert all(len(g) == 2 and "tool_calls" not in g[-1] for g in guesses)
    values = [int(g[-1]["content"].split()[-1].rstrip(".")) for g in guesses]
    assert all(0.85 * 1035 - 1 <= v <= 1.15 * 1035 + 1 for v in values) and len(set(values)) > 10
    rates = [len(task.sft_conversation(23, 45, rng, tool_rate=0.3)) > 2 for _ in range(2000)]
    assert 0.25 < sum(rates) / len(rates) < 0.35


@needs_tool_parsing
def test_short_tools_block_is_accepted_by_trl_ppo(task, tool_tokenizer):
    from trl_ppo.agents.chat import ToolChat
    from trl_ppo.agents.tools import schemas, toolbox

    chat = ToolChat(tool_tokenizer, schemas(toolbox([task.multiply])), tool_tokenizer.eos_token_id)  # its checks
    prompt = tool_tokenizer.decode(task.prompt_ids(tool_tokenizer, 23, 45))
    assert prompt.startswith("<|im_start|>system\nTools: multiply(a, b)<|im_end|>\n<|im_start|>user\nWhat is 23")
    call = '<tool_call>{"name": "multiply", "arguments": {"a": 23, "b": 45}}</tool_call><|im_end|>'
    calls, failed = chat.parse_tool_calls(tool_tokenizer.encode(call), task.prompt_ids(tool_tokenizer, 23, 45))
    assert not failed and [(c.name, c.arguments) for c in calls] == [("multiply", {"a": 23, "b": 45})]


def test_held_out_problems_are_never_in_the_pool(task):
    held_out, pool = task.split_problems()
    assert len(held_out) == 200 and not set(held_out) & set(pool)
    assert len(held_out) + len(pool) == 90 * 90 and all(10 <= a <= 99 and 10 <= b <= 99 for a, b in pool)


@pytest.mark.slow
@needs_tool_parsing
def test_smoke_run_writes_a_row_per_config_and_a_table(tmp_path):
    pytest.importorskip("trl", reason="TRL 1.12 comes with the dev and bench extras")
    results = tmp_path / "agent.jsonl"
    command = [sys.executable, SCRIPT, "--smoke", "--results", str(results), "--output_dir", str(tmp_path / "out")]
    command += ["--configs", "ppo+tools", "grpo+tools"]  # ppo-no-tools is ppo+tools' code with max_turns=1
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [row["config"] for row in rows] == ["ppo+tools", "grpo+tools"]
    for row in rows:
        assert row["smoke"] and row["seconds"] > 0 and len(row["scores"]) == row["rl"]["updates"]
        for when in ("before", "after"):
            for protocol in ("greedy", "sampled"):
                result = row[when][protocol]
                assert 0.0 <= result["success"] <= 1.0 and 0.0 <= result["tool_call_rate"] <= 1.0
    assert len(rows[0]["tool_calls"]) == rows[0]["rl"]["updates"]  # env/tool_calls_mean logged per update
    assert "| ppo+tools | trl_ppo | 1 |" in done.stdout and "| grpo+tools | trl (TRL 1.12 GRPO) | 1 |" in done.stdout

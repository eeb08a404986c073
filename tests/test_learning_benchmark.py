"""The learning benchmark (benchmark/learning/learning.py): its rule reward, the same rule as a reward model for
TRL 1.12 scoring exactly like trl_ppo's reward function, and its small CPU form as a smoke test (no learning
asserted)."""

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmark", "learning", "learning.py")


@pytest.fixture(scope="module")
def task():
    sys.path.insert(0, os.path.join(ROOT, "benchmark", "learning"))
    try:
        return importlib.import_module("learning_task")
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmark", "learning"))


def test_rule_reward_scores_exact_sums_only(task):
    assert task.correct_answer("23+45=") == "68" and task.correct_answer("99+99=") == "198"
    assert task.correct_answer("hello") is None
    prompts = ["23+45=", "23+45=", "23+45=", "9+3=", "9+3=", "hello", "27+45="]
    completions = ["68", " 68 ", "680", "12", "", "68", "62"]  # 62: the demonstrations' forgotten carry
    assert task.addition_reward(prompts, completions) == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]


def test_demonstrations_forget_the_carry_only_on_carry_problems(task):
    import random

    rng = random.Random(0)
    assert {task.demonstration(23, 45, rng, 1.0) for _ in range(20)} == {"68"}  # no carry: always right
    assert {task.demonstration(27, 45, rng, 1.0) for _ in range(20)} == {"62"}
    assert {task.demonstration(27, 45, rng, 0.5) for _ in range(200)} == {"62", "72"}
    assert {task.demonstration(27, 45, rng, 0.0) for _ in range(20)} == {"72"}


def _episodes(tokenizer):
    """Left-padded prompts and hand-made responses of 5 tokens (before any truncation at EOS)."""
    eos, pad = "[EOS]", "[PAD]"
    cases = [  # (prompt, response tokens)
        ("23+45=", ["6", "8", eos, pad, pad]),  # correct
        ("23+45=", ["6", "8", eos, "7", "7"]),  # correct, tokens after EOS ignored
        ("23+45=", ["6", pad, "8", eos, pad]),  # a sampled PAD inside the response (dropped by both decodings)
        ("23+45=", ["6", "8", "0", eos, pad]),  # wrong
        ("23+45=", ["6", "8", "0", "0", "0"]),  # wrong, no EOS: -1
        ("23+45=", ["6", "8", pad, pad, pad]),  # right digits but no EOS: 1 - 1
        ("9+3=", ["1", "2", eos, pad, pad]),
        ("9+3=", [eos, "1", "2", pad, pad]),  # empty answer
        ("99+99=", ["1", "9", "8", eos, pad]),
        ("99+99=", ["1", "8", "8", eos, pad]),  # the forgotten carry
        ("27+45=", ["7", "+", "2", eos, pad]),
    ]
    queries = tokenizer([p for p, _ in cases], padding=True, return_tensors="pt")
    responses = torch.tensor([tokenizer.convert_tokens_to_ids(r) for _, r in cases])
    return [p for p, _ in cases], queries["input_ids"], queries["attention_mask"].bool(), responses


def test_trl_reward_module_scores_exactly_like_the_trl_ppo_reward_function(task):
    pytest.importorskip("trl", reason="TRL 1.12 comes with the dev and bench extras")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.ppo.ppo_trainer import truncate_response
    from trl.experimental.utils import get_reward

    from trl_ppo import ppo
    from trl_ppo.rewards import build_rewards, compute_scores
    from trl_ppo.rollout import Rollout

    tokenizer = task.build_char_tokenizer()
    prompts, queries, query_mask, responses = _episodes(tokenizer)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id

    # TRL 1.12's train(): truncate after the stop token, score with get_reward, then the missing-EOS penalty.
    recorder = task.Recorder()
    module = task.RuleRewardModel(tokenizer, recorder)
    postprocessed = truncate_response(eos, pad, responses)
    _, trl_scores, _ = get_reward(module, torch.cat([queries, postprocessed], 1), pad, queries.size(1))
    trl_scores = trl_scores.clone()
    trl_scores[~torch.any(postprocessed == eos, dim=-1)] -= 1.0

    # trl_ppo: the reward function on the decoded prompts and completions, the penalty on its response mask.
    rollout = Rollout(queries, query_mask, responses, ppo.response_mask_after_stop(responses, eos))
    rewards = build_rewards(task.addition_reward)
    ours, _ = compute_scores(rewards, rollout, tokenizer, {}, 64, penalty_token_id=eos, missing_eos_penalty=1.0)

    expected = [1.0, 1.0, 1.0, 0.0, -1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    assert trl_scores.tolist() == expected
    assert ours.tolist() == expected
    assert recorder.flush() == pytest.approx(6 / 11)  # the module counts the correct answers it scored


@pytest.mark.slow
def test_smoke_run_writes_rows_a_table_and_a_plot(tmp_path):
    pytest.importorskip("trl", reason="TRL 1.12 comes with the dev and bench extras")
    results, plot = tmp_path / "learning.jsonl", tmp_path / "learning.png"
    command = [sys.executable, SCRIPT, "--smoke", "--results", str(results), "--output_dir", str(tmp_path / "out")]
    done = subprocess.run(command + ["--plot", str(plot)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert {row["trainer"] for row in rows} == {"trl_ppo", "trl"}
    assert rows[0]["config"] == "trl_ppo" and rows[-1]["config"] == "trl"
    for row in rows:
        updates = row["ppo"]["updates"]
        assert row["smoke"] and updates == 2
        assert 0.0 <= row["accuracy_before"] <= 1.0 and 0.0 <= row["accuracy_after"] <= 1.0
        assert len(row["sampled_accuracy"]) == updates and len(row["scores"]) == updates
        assert all(0.0 <= x <= 1.0 for x in row["sampled_accuracy"])
        # a score is the rule's 1/0 minus the missing-EOS penalty: never above the update's accuracy
        assert all(s <= a + 1e-6 for s, a in zip(row["scores"], row["sampled_accuracy"]))
        assert [u for u, _ in row["eval_accuracy"]] == [1, 2]
        assert row["seconds"] > 0
    assert "| config | seeds | accuracy before |" in done.stdout and "| trl (TRL 1.12) | 1 |" in done.stdout
    assert plot.stat().st_size > 10_000

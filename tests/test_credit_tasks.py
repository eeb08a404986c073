"""The credit tasks (benchmark/credit/): their rules on hand-played episodes, the one-letter chat format read back
as calls, the runner's resume and summary, and (slow) short runs of the runner and of TRL's cross-check that learn
chain_2 end to end."""

import json
import os
import random
import sys

import pytest
from conftest import REPO_ROOT, needs_tool_parsing

sys.path[:0] = [os.path.join(REPO_ROOT, "benchmark", d) for d in ("credit", "agents", "learning")]
import tasks  # noqa: E402


def play(env: tasks.Task, letters: str, start=None, seed=0) -> tuple[str, list]:
    """Reset `env`, say `letters` one by one -> (the first observation, each tool answer)."""
    first = env.reset(seed=seed, start=start)
    return first, [getattr(env, letter)() for letter in letters]


def test_key_to_door_pays_at_the_door_only_when_the_key_was_taken_first():
    env = tasks.KeyToDoor(distractors=2)
    first, answers = play(env, "abcd")
    assert first == "key" and [a if isinstance(a, str) else a[0] for a in answers] == ["apple", "apple", "door", "end"]
    assert env.success and env.get_reward() == 1.0
    play(env, "bacd")  # the key not taken in the first room: saying its letter later does nothing
    assert not env.success and env.get_reward() == 0.0
    play(env, "abc")  # stopped before the door
    assert env.get_reward() == 0.0


def test_key_to_door_distractor_rewards_are_small_noise_whatever_is_said():
    rewards = []
    for seed in range(40):
        env = tasks.KeyToDoor(distractors=4)
        _, answers = play(env, random.Random(seed).choice(["aaaaaa", "bcdbcd"]), seed=seed)
        assert answers[0] == "apple" and not isinstance(answers[-1], tuple)  # none in the key's room nor the door's
        rewards += [a[1] if isinstance(a, tuple) else 0.0 for a in answers[1:5]]
    assert set(rewards) == {0.0, 0.1, 0.2}


@pytest.mark.parametrize("length", [2, 4, 8])
def test_the_chain_pays_for_its_first_letter_only_at_its_end(length):
    env = tasks.Chain(length)
    _, answers = play(env, tasks.TARGET + "a" * (length - 1))
    assert answers == ["wait"] * (length - 1) + ["end"] and env.get_reward() == 1.0
    play(env, tasks.TARGET + "a" * (length - 2))  # one turn short
    assert env.get_reward() == 0.0
    play(env, "b" + tasks.TARGET * (length - 1))
    assert env.get_reward() == 0.0
    assert getattr(env, "a")() == "end" and env.get_reward() == 0.0  # past the end nothing changes


def test_random_start_draws_its_own_training_state_and_pays_a_bonus_by_state_besides_the_first_letter():
    starts = set()
    for _ in range(200):
        env = tasks.RandomStart(4)
        starts.add(env.reset(seed=7))  # the same row for all: a group's members still get their own states
    assert starts <= set(tasks.TRAIN_STATES) and len(starts) > 30
    assert not starts & set(tasks.HELD_OUT) and len(tasks.HELD_OUT) == 16
    assert {s[0] for s in tasks.HELD_OUT} == set(tasks.ACTIONS)
    env = tasks.RandomStart(4)
    first, answers = play(env, tasks.TARGET + "abc", start="dcb")
    assert first == "dcb" and answers == ["wait", "wait", "wait", ("end", 0.75)] and env.get_reward() == 1.0
    _, answers = play(env, "b" + tasks.TARGET * 3, start="bcb")
    assert answers[-1] == ("end", 0.25) and env.get_reward() == 0.0
    assert play(env, tasks.TARGET * 4, start="acb")[1][-1] == "end" and env.get_reward() == 1.0  # no bonus for a


@needs_tool_parsing
def test_a_lone_letter_is_parsed_as_a_call_and_anything_else_is_text():
    from trl_ppo.agents.chat import ToolChat
    from trl_ppo.agents.tools import schemas, toolbox

    tokenizer = tasks.build_tokenizer()
    chat = ToolChat(tokenizer, schemas(toolbox([], tasks.Chain(2))), tokenizer.eos_token_id)  # its checks pass
    prefix = tokenizer.encode("<|im_start|>ugo<|im_end|><|im_start|>a")
    parsed = {turn: chat.parse_tool_calls(tokenizer.encode(turn + "<|im_end|>"), prefix)
              for turn in ("b", "", "x", "ab", "wait")}
    assert [call.name for call in parsed["b"][0]] == ["b"]
    assert all(calls == [] and not failed for turn, (calls, failed) in parsed.items() if turn != "b")
    assert tokenizer.decode(chat.answer_ids([_result("b", "wait")]).ids) == "<|im_start|>owait<|im_end|><|im_start|>a"


def _result(name, content):
    from trl_ppo.agents.execution import ToolResult

    return ToolResult(name=name, content=content)


def test_random_episodes_render_one_letter_per_turn_and_end_on_an_empty_turn():
    rng = random.Random(0)
    messages = tasks.random_episode(tasks.Chain(4), rng)
    calls = [m["tool_calls"][0]["function"]["name"] for m in messages if m.get("tool_calls")]
    assert len(calls) == 4 and set(calls) <= set(tasks.ACTIONS) and messages[-1] == {"role": "assistant", "content": ""}
    firsts = [tasks.random_episode(tasks.Chain(2), rng)[1]["tool_calls"][0]["function"]["name"] for _ in range(400)]
    assert all(60 < firsts.count(letter) < 140 for letter in tasks.ACTIONS)  # uniform: success 1 in 4


def test_the_runner_skips_rows_it_has_and_counts_episodes_to_a_level(tmp_path):
    import run  # benchmark/credit/run.py, on the path above: a broken import must fail, not skip

    assert run.episodes_to_reach([0.2, 0.5, 0.85, 0.7], 16) == 48
    assert run.episodes_to_reach([0.2, 0.5], 16) is None
    out = tmp_path / "rows.jsonl"
    args = run.parse_args(["--task", "chain_2", "--estimator", "rloo", "--gae_level", "turn", "--out", str(out)])
    assert args.gae_level is None  # a critic-free row has no GAE level
    row = {"task": "chain_2", "estimator": "rloo", "gae_level": None, "seed": 0, "lr": args.lr, "updates": args.updates,
           "episodes_per_update": 16, "num_generations": 4}
    out.write_text(json.dumps(row) + "\n")
    assert run.has_row(str(out), vars(args), run.KEY_FIELDS)
    run.main(["--task", "chain_2", "--estimator", "rloo", "--out", str(out)])  # would train for minutes otherwise
    assert len(out.read_text().splitlines()) == 1


def assert_learnt_chain_2(row, updates: int, batch: int):
    """A row of 12 updates of 16 episodes at lr 3e-3 on chain_2 (seed 0): the first letter `c` learnt. Measured
    (OMP_NUM_THREADS=1, seeds 0-4), sampled success before -> after over 64 episodes: trl_ppo's GRPO 0.30 -> 0.77,
    0.30 -> 0.72, 0.28 -> 0.77, 0.30 -> 0.73, 0.39 -> 0.83; TRL's 0.30 -> 0.81, 0.30 -> 0.72, 0.28 -> 0.70,
    0.30 -> 0.83, 0.39 -> 0.83 (gains 0.42 to 0.53); greedy 1.0 after in all ten; the curve's last 4 updates above
    its first 4 by 0.25 to 0.55. Re-measured on 2026-12-02, on an AMD EPYC, where that seed 0 no longer passed
    (torch 2.13.0, transformers 5.24.0, accelerate 1.16.0; trl_ppo's GRPO, seeds 0-4): 0.30 -> 0.81, 0.30 -> 0.66,
    0.28 -> 0.69, 0.30 -> 0.86, 0.39 -> 0.84, greedy 1.0 in all five, the curve's gap 0.08 (seed 0: one update of 16
    episodes at 0.19 among its last 4), 0.44, 0.44, 0.34, 0.39. The curve is 16 episodes an update: its margin is
    the smaller, the 64-episode evaluation carries the test."""
    curve = row["success_curve"]
    assert len(curve) == updates and all(value * batch == int(value * batch) for value in curve)  # k of 16 episodes
    assert sum(curve[-4:]) / 4 >= sum(curve[:4]) / 4 + 0.05
    assert row["final"]["sampled"] >= row["before"]["sampled"] + 0.25 and row["final"]["greedy"] == 1.0


@pytest.mark.slow
@needs_tool_parsing
def test_the_runner_learns_chain_2_end_to_end_and_writes_its_row(tmp_path):
    import subprocess

    out = tmp_path / "rows.jsonl"
    command = [sys.executable, os.path.join(REPO_ROOT, "benchmark", "credit", "run.py"), "--task", "chain_2",
               "--estimator", "grpo", "--updates", "12", "--batch", "16", "--lr", "3e-3", "--eval_episodes", "64",
               "--out", str(out), "--work_dir", str(tmp_path)]
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    row = json.loads(out.read_text())
    assert row["task"] == "chain_2" and row["estimator"] == "grpo" and row["cpu_seconds"] > 0
    assert_learnt_chain_2(row, updates=12, batch=16)


def test_trl_accepts_the_one_letter_format_as_a_tool_calling_template():
    """TRL's GRPOTrainer refuses a chat template that drops a call's arguments; the letters take none, but the
    cross-check (trl_grpo.py) needs the format to pass TRL's check."""
    chat_template_utils = pytest.importorskip("trl.chat_template_utils")
    assert chat_template_utils.supports_tool_calling(tasks.build_tokenizer())


@pytest.mark.slow
@needs_tool_parsing
def test_the_trl_cross_check_learns_chain_2_and_writes_a_row_counted_from_the_environments(tmp_path):
    import subprocess

    pytest.importorskip("trl")
    out = tmp_path / "rows.jsonl"
    command = [sys.executable, os.path.join(REPO_ROOT, "benchmark", "credit", "trl_grpo.py"), "--task", "chain_2",
               "--updates", "12", "--batch", "16", "--lr", "3e-3", "--eval_episodes", "64", "--out", str(out),
               "--work_dir", str(tmp_path)]
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    row = json.loads(out.read_text())
    assert row["estimator"] == "trl_grpo" and row["trainer"].startswith("trl ") and row["episodes"] == 12 * 16
    assert_learnt_chain_2(row, updates=12, batch=16)


def test_the_trl_cross_check_pays_what_the_tools_paid_through_get_reward():
    """TRL reads a tool's answer as text: the cross-check's environments answer with the observation alone and add
    the payment (random_start's end payment, key_to_door's apples) to `get_reward`, while the success curve counts
    the success only."""
    import trl_grpo

    outcomes = []
    env = trl_grpo.recording("random_start", outcomes)()
    env.reset(seed=0, start="dab")
    answers = [env.c(), env.a(), env.a(), env.a()]
    assert all(isinstance(answer, str) for answer in answers) and answers[-1] == "end"
    assert env.get_reward() == 1.0 + 3 * tasks.BONUS  # success, and the start's payment for "d"
    assert outcomes == [1.0]

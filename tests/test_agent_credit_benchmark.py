"""The credit-across-turns benchmark (benchmark/agents/agent_credit.py, issue 35): its game, the SFT demonstrations
rendered as the trainers render the prompt, and its learning-curve summary."""

import os
import random
import sys

import pytest
from conftest import REPO_ROOT, load_example_script

sys.path[:0] = [os.path.join(REPO_ROOT, "benchmark", d) for d in ("agents", "learning")]  # guess_game: agent_task


@pytest.fixture(scope="module")
def game():
    return load_example_script("guess_game", folder="benchmark/agents")


def test_the_game_answers_higher_lower_correct_and_rewards_finding(game):
    play = game.GuessGame()
    play.reset(target=6, prompt="ignored")
    assert [play.guess(4), play.guess(7), play.get_reward(), play.guess(6), play.get_reward()] == [
        "higher", "lower", 0.0, "correct", 1.0]
    assert play.guesses == 3


def test_sft_games_use_the_trainers_prompt_and_end_on_found(game):
    from trl_ppo.agents.tools import schemas, toolbox

    task = load_example_script("agent_task", folder="benchmark/agents")
    tokenizer = task.build_tokenizer()
    tools = schemas(toolbox([], game.GuessGame()))  # as trl_ppo's AgentRunner renders an environment's tools
    rendered = tokenizer.apply_chat_template(game.prompt_messages(), tools=tools, tokenize=False,
                                             add_generation_prompt=True)
    assert game.prompt_ids(tokenizer) == tokenizer.encode(rendered, add_special_tokens=False)
    rng = random.Random(0)
    games = [game.random_game(rng.randint(1, 8), rng) for _ in range(50)]
    found = [g for g in games if g[-1]["content"] == "Found it."]
    assert all(g[-2]["content"] == "correct" for g in found)
    assert all(len(g) == 1 + 2 * game.GUESSES for g in games if g not in found)  # three misses: no last turn
    ids, labels = task.sft_example(tokenizer, found[0], [game.guess])
    assert ids[: len(game.prompt_ids(tokenizer))] == game.prompt_ids(tokenizer)


def test_episodes_to_reach_a_level():
    credit = load_example_script("agent_credit", folder="benchmark/agents")
    row = {"scores": [0.2, 0.55, 0.4, 0.8], "episodes_per_update": 16}
    assert [credit.episodes_to_reach(row, level) for level in (0.5, 0.7, 0.9)] == [32, 64, None]


def guesses_and_answers(messages: list[dict]) -> list[tuple[int, str]]:
    calls = [m["tool_calls"][0]["function"]["arguments"]["n"] for m in messages if m.get("tool_calls")]
    return list(zip(calls, [m["content"] for m in messages if m["role"] == "tool"]))


def test_the_consistent_guesser_only_guesses_numbers_the_answers_leave_possible(game):
    rng = random.Random(1)
    for target in [rng.randint(1, 8) for _ in range(200)]:
        low, high = 1, 8
        for n, answer in guesses_and_answers(game.random_game(target, rng)):
            assert low <= n <= high
            low, high = (n + 1, high) if answer == "higher" else (low, n - 1) if answer == "lower" else (n, n)
    # The blind guesser (the first version of the benchmark) does not read the answers.
    blind = [guesses_and_answers(game.random_game(8, rng, "blind")) for _ in range(200)]
    assert any(later < first for (first, _), (later, _) in (g[:2] for g in blind if len(g) > 1))

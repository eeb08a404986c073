"""The task of `benchmark/agents/agent_credit.py`: a stateful game over several turns, where credit must cross turns.

* `GuessGame`: the environment (one per episode, `environment_factory=GuessGame`): a hidden number from 1 to 8
  (the dataset's `target` column, given to `reset`), a `guess(n)` tool that answers "higher", "lower" or
  "correct", and `get_reward()`: 1.0 when the number was found, else 0.0. The prompt is the same for every
  target, so the model can only find the number by reading the answers. With `max_turns=4` the model has three
  answered guesses (a fourth turn's call is never answered): guessing uniformly at random finds it with
  probability 1 - (7/8)^3 = 0.33; halving the range each time (4, then 2 or 6, ...) finds 7 targets of 8.
* `SFTSettings` / `train_sft`: a tiny Qwen2 trained from scratch on games of a random guesser that says "Found it."
  after "correct". The default guesser ("consistent") draws each guess uniformly from the numbers the answers so
  far leave possible: the start reads the answers but does not halve the range, and finds the number with
  probability 0.62 (halving: 0.875), so what RL must learn is which of the possible numbers to guess, a choice
  whose worth shows only at the game's end. The "blind" guesser (uniform from 1 to 8, the answers ignored,
  success 0.33) was the first version of this benchmark: nothing learnt from it in 128 episodes.
* `evaluate`: games on every target through trl_ppo's own turn loop, greedy (one per target) and sampled.
"""

from __future__ import annotations

import os
import random
from dataclasses import asdict, dataclass

import agent_task
import torch

LOW, HIGH = 1, 8
GUESSES = 3  # answered guesses per game: `max_turns` = GUESSES + 1
PROMPT = f"Find my number from {LOW} to {HIGH}."


def guess(n: int) -> str:
    """Guess the hidden number.

    Args:
        n: the number guessed.
    """
    raise NotImplementedError("the schema of `GuessGame.guess`, for rendering SFT conversations")


class GuessGame:
    """One game: `reset(target=...)`, then `guess(n)` calls; `get_reward()` 1.0 once the target was guessed."""

    def reset(self, **row) -> None:
        self.target, self.found, self.guesses = int(row["target"]), False, 0

    def guess(self, n: int) -> str:
        """Guess the hidden number.

        Args:
            n: the number guessed.
        """
        self.guesses += 1
        if int(n) == self.target:
            self.found = True
            return "correct"
        return "higher" if self.target > int(n) else "lower"

    def get_reward(self) -> float:
        return 1.0 if self.found else 0.0


def prompt_messages() -> list[dict]:
    return [{"role": "user", "content": PROMPT}]


def prompt_ids(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(prompt_messages(), tools=[guess], tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------------------------------------------- SFT
@dataclass(frozen=True)
class SFTSettings:
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 8
    rope_theta: float = 100.0
    steps: int = 400
    batch_size: int = 16
    learning_rate: float = 2e-3
    seed: int = 0
    guesser: str = "consistent"  # or "blind"

    def key(self) -> str:
        return "guess-sft-" + "-".join(f"{k}{v}" for k, v in asdict(self).items())


def random_game(target: int, rng: random.Random, guesser: str = "consistent") -> list[dict]:
    """A game of a random guesser: up to `GUESSES` calls, "Found it." after "correct". Each guess is uniform over
    the numbers still possible ("consistent") or over `LOW..HIGH` ("blind")."""
    game, messages = GuessGame(), prompt_messages()
    game.reset(target=target)
    low, high = LOW, HIGH
    for _ in range(GUESSES):
        n = rng.randint(low, high) if guesser == "consistent" else rng.randint(LOW, HIGH)
        call = {"type": "function", "function": {"name": "guess", "arguments": {"n": n}}}
        answer = game.guess(n)
        low, high = (n + 1, high) if answer == "higher" else (low, n - 1) if answer == "lower" else (low, high)
        messages += [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "guess", "content": answer},
        ]
        if game.found:
            return messages + [{"role": "assistant", "content": "Found it."}]
    return messages


def train_sft(tokenizer, settings: SFTSettings, output_dir: str, log=print) -> str:
    """Train (or reuse) the SFT policy -> its folder (`<output_dir>/<settings key>`)."""
    from learning_task import save_sft

    path = os.path.join(output_dir, settings.key())
    if os.path.exists(os.path.join(path, "done.json")):
        return path
    model = agent_task.build_policy(tokenizer, settings)
    rng = random.Random(settings.seed)

    def games() -> list:
        played = [random_game(rng.randint(LOW, HIGH), rng, settings.guesser) for _ in range(settings.batch_size)]
        return [agent_task.sft_example(tokenizer, g, [guess]) for g in played]

    agent_task.one_cycle_sft(model, tokenizer, settings, games, log)
    return save_sft(model, tokenizer, settings, path)


# ---------------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(model, tokenizer, budget: int, temperature: float | None = None, games_per_target=1, seed=0) -> dict:
    """Games on every target (`games_per_target` each), greedy (`temperature` None) or sampled with `seed` ->
    {"success", "guesses" (mean answered guesses), "sample" (the first game after its prompt)}."""
    from trl_ppo.agents.chat import ToolChat
    from trl_ppo.agents.tools import schemas, toolbox
    from trl_ppo.rollout.turn_loop import Episode, run_turns

    was_training = model.training
    model.eval()
    episodes = []
    for target in [t for t in range(LOW, HIGH + 1) for _ in range(games_per_target)]:
        game = GuessGame()
        game.reset(target=target)
        episodes.append(Episode(prompt_ids(tokenizer), toolbox([], game), game))
    chat = ToolChat(tokenizer, schemas(episodes[0].tools), tokenizer.eos_token_id)
    torch.manual_seed(seed)
    run_turns(episodes, agent_task.model_sampler(model, tokenizer, temperature), chat, GUESSES + 1, budget)
    model.train(was_training)
    return {
        "success": sum(e.environment.found for e in episodes) / len(episodes),
        "guesses": sum(e.environment.guesses for e in episodes) / len(episodes),
        "sample": tokenizer.decode(episodes[0].response),
    }

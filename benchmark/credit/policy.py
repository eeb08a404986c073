"""The starting policy of the credit tasks and its evaluation.

* `train_sft`: a tiny Qwen2 trained from scratch on episodes of uniformly random letters (`tasks.random_episode`),
  so it speaks the format (one letter a turn, an empty turn after "end") and chooses at chance: 1 in 4.
* `evaluate`: episodes through trl_ppo's own turn loop from the starts `tasks.eval_starts` gives (held-out ones for
  `random_start`), greedy or sampled -> their success rate.
"""

from __future__ import annotations

import itertools
import os
import random
from dataclasses import asdict, dataclass

import agent_task  # benchmark/agents/ and learning/ are on the path (run.py and the tests put them there)
import guess_game
import tasks
import torch


@dataclass(frozen=True)
class SFTSettings(guess_game.SFTSettings):
    """guess_game's settings, smaller: a 32-wide model learns one letter a turn in 200 steps (~8 CPU-s)."""

    hidden_size: int = 32
    num_heads: int = 4
    steps: int = 200
    learning_rate: float = 3e-3

    def key(self, task: str) -> str:
        fields = {k: v for k, v in asdict(self).items() if k != "guesser"}  # guess_game's own, unused here
        return f"credit-sft-{task}-" + "-".join(f"{k}{v}" for k, v in fields.items())


def prompt_ids(tokenizer, env: tasks.Task, start: str | None, seed: int) -> list[int]:
    """An episode's prompt as trl_ppo's AgentRunner renders it: the letters' system line, the prompt and `reset`'s
    observation."""
    from trl_ppo.agents.tools import schemas, toolbox

    added = env.reset(seed=seed, start=start)
    messages = [{"role": "user", "content": f"{tasks.PROMPT}\n\n{added}"}]
    text = tokenizer.apply_chat_template(messages, tools=schemas(toolbox([], env)), tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def train_sft(task: str, tokenizer, settings: SFTSettings, output_dir: str, log=print) -> str:
    """Train (or reuse) the SFT policy of `task` -> its folder (`<output_dir>/<settings key>`)."""
    from learning_task import save_sft
    from trl_ppo.agents.tools import schemas, toolbox

    path = os.path.join(output_dir, settings.key(task))
    if os.path.exists(os.path.join(path, "done.json")):
        return path
    model = agent_task.build_policy(tokenizer, settings)
    rng, env, episodes = random.Random(settings.seed), tasks.TASKS[task](), itertools.count()
    tools = schemas(toolbox([], env))

    def demonstrations() -> list:
        seed = -1 - next(episodes)  # each batch's noise seed (negative: never a training row's)
        return [agent_task.sft_example(tokenizer, tasks.random_episode(env, rng, seed=seed), tools)
                for _ in range(settings.batch_size)]

    agent_task.one_cycle_sft(model, tokenizer, settings, demonstrations, log, name=f"SFT {task}")
    return save_sft(model, tokenizer, settings, path)


@torch.no_grad()
def evaluate(model, tokenizer, task: str, budget: int, temperature: float | None = None, episodes: int = 64,
             seed: int = 0) -> dict:
    """`episodes` episodes cycling over `tasks.eval_starts(task)`, greedy (`temperature` None) or sampled with
    `seed` -> {"success", "first" (the share of each first letter said), "sample" (the first episode)}. Their noise
    seeds (negative) are never the training rows' (non-negative)."""
    from trl_ppo.agents.chat import ToolChat
    from trl_ppo.agents.tools import schemas, toolbox
    from trl_ppo.rollout.turn_loop import Episode, run_turns

    was_training = model.training
    model.eval()
    starts = tasks.eval_starts(task)
    played = []
    for index in range(episodes):
        env = tasks.TASKS[task]()
        prompt = prompt_ids(tokenizer, env, starts[index % len(starts)], seed=-1 - seed * episodes - index)
        played.append(Episode(prompt, toolbox([], env), env))
    chat = ToolChat(tokenizer, schemas(played[0].tools), tokenizer.eos_token_id)
    torch.manual_seed(seed)
    run_turns(played, agent_task.model_sampler(model, tokenizer, temperature, batch_size=episodes), chat,
              played[0].environment.steps + 1, budget)
    model.train(was_training)
    firsts = [e.environment.said[0] if e.environment.said else "" for e in played]
    return {
        "success": sum(e.environment.success for e in played) / len(played),
        "first": {letter: firsts.count(letter) / len(played) for letter in tasks.ACTIONS},
        "sample": tokenizer.decode(played[0].response),
    }

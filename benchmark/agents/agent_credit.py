"""Credit across turns (issue 35): token-level GAE against turn-level GAE (`gae_level="turn"`) and TRL 1.12's GRPO,
at the same number of episodes, on a stateful game over several turns; offline, on the CPU.

    python benchmark/agents/agent_credit.py                 # 3 configs x seeds 0 1 2
    python benchmark/agents/agent_credit.py --smoke         # tiny SFT, 1 update, 1 seed
    python benchmark/agents/agent_credit.py --report        # the table of the rows already in --results

The task (`guess_game.py`): find a hidden number from 1 to 8 with a `guess(n)` tool answering "higher", "lower" or
"correct"; three answered guesses; reward 1.0 when found. The start is a tiny Qwen2 SFT'd on a random guesser
that reads the answers but draws each guess uniformly from the numbers still possible (success 0.62 in
expectation); halving the range finds 7 targets of 8, so what is left to learn is which number to guess, a choice
whose worth shows only at the end of the game. Every game's reward comes from the environment's `get_reward()` in
both trainers (`environment_factory=GuessGame`).

Configs (same SFT start, episodes and seeds; each run in a fresh process):
* `ppo-token`: trl_ppo, `max_turns=4`, `lam=0.95`, `gae_level="token"` (GAE over the model's tokens);
* `ppo-turn`: the same with `gae_level="turn"` (Turn-PPO's GAE: λ and γ once per turn, one advantage per turn);
* `grpo`: TRL 1.12's `GRPOTrainer(..., environment_factory=GuessGame)`, G = 4 games per prompt, TRL's defaults.

Measured: the mean reward of each update's sampled games (the learning curve: episodes to reach a success level),
and before/after training, games on every target played by trl_ppo's turn loop: greedy (8) and sampled at the
training temperature (16 per target). One JSON line per run appended to `--results`; a table printed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "learning")]  # learning.py, learning_task.py
import guess_game as game  # noqa: E402
from agent_tools import common_args, mean_se  # noqa: E402
from learning import log, run_arguments, run_seeds, serve_worker  # noqa: E402

CONFIGS: dict[str, dict] = {
    "ppo-token": {"gae_level": "token"},
    "ppo-turn": {"gae_level": "turn"},
    "grpo": {},
    "ppo-token-lam1": {"gae_level": "token", "lam": 1.0},
    # A tighter lower clip: a token's probability may fall by 5% per update, not 20% (DAPO's decoupled clip range).
    "ppo-turn-cliplow": {"gae_level": "turn", "cliprange_low": 0.05, "cliprange_high": 0.2},
}
DEFAULT_CONFIGS = list(CONFIGS)[:3]
RL = dict(
    updates=24,
    per_device_train_batch_size=8,
    gradient_accumulation_steps=4,  # 32 games per update: 768 in all
    num_ppo_epochs=2,  # GRPO's `num_iterations`
    learning_rate=1e-4,  # 2e-4 and 3e-4 broke the markup after one update (KL 8-17), then recovered to the start
    temperature=1.0,
    response_length=512,  # three calls and answers and a fourth turn (at 400 the 4th call was cut: a missing EOS)
    num_generations=4,  # GRPO only
    lam=0.95,
)
SFT = game.SFTSettings(steps=1000)  # after 400 steps it found 0.35 sampled at 1.0 (0.55 after 1,000): broken markup
SMOKE_RL = dict(RL, updates=1, per_device_train_batch_size=4, gradient_accumulation_steps=1, num_ppo_epochs=1)
SMOKE_SFT = game.SFTSettings(hidden_size=16, num_heads=2, num_layers=1, steps=1, batch_size=4)
SUCCESS_LEVELS = (0.5, 0.7)  # the learning curve's levels: episodes until an update's mean reward reaches each
NUM_PROMPTS = 2000  # rows (targets drawn uniformly); each trainer reads `updates x batch` episodes of them


def dataset(seed: int):
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    targets = [rng.randint(game.LOW, game.HIGH) for _ in range(NUM_PROMPTS)]
    return Dataset.from_dict({"prompt": [game.prompt_messages() for _ in targets], "target": targets})


def ppo_trainer(spec: dict, tokenizer, policy):
    import torch
    from transformers import AutoModelForSequenceClassification

    from trl_ppo import PPOConfig, PPOTrainer

    rl = spec["rl"]
    batch = rl["per_device_train_batch_size"] * rl["gradient_accumulation_steps"]
    config = PPOConfig(
        **common_args(spec), total_episodes=batch * rl["updates"], num_ppo_epochs=rl["num_ppo_epochs"],
        response_length=rl["response_length"], max_turns=game.GUESSES + 1, stop_token="eos",
        missing_eos_penalty=1.0, lam=rl["lam"], gae_level=rl["gae_level"],
        **{name: rl[name] for name in ("cliprange_low", "cliprange_high") if name in rl},
        local_rollout_forward_batch_size=batch, num_sample_generations=0,
    )
    value_model = AutoModelForSequenceClassification.from_pretrained(spec["sft_path"], num_labels=1)
    torch.manual_seed(spec["seed"])
    torch.nn.init.normal_(value_model.score.weight, std=value_model.config.initializer_range)
    return PPOTrainer(
        args=config, processing_class=tokenizer, model=policy, ref_model=None, value_model=value_model,
        train_dataset=dataset(spec["seed"]), environment_factory=game.GuessGame,
    )


def grpo_trainer(spec: dict, tokenizer, policy):
    """TRL 1.12's GRPO: `updates x num_iterations` steps, each generation `batch` games (batch / G prompts x G)."""
    from trl import GRPOConfig, GRPOTrainer

    rl = spec["rl"]
    config = GRPOConfig(
        **common_args(spec), max_steps=rl["updates"] * rl["num_ppo_epochs"], num_generations=rl["num_generations"],
        num_iterations=rl["num_ppo_epochs"], max_completion_length=rl["response_length"],
        max_tool_calling_iterations=game.GUESSES,
    )
    return GRPOTrainer(
        model=policy, args=config, train_dataset=dataset(spec["seed"]), processing_class=tokenizer,
        environment_factory=game.GuessGame,
    )


def evaluate(policy, tokenizer, rl: dict) -> dict:
    budget = rl["response_length"]
    return {
        "greedy": game.evaluate(policy, tokenizer, budget),
        "sampled": game.evaluate(policy, tokenizer, budget, rl["temperature"], games_per_target=16),
    }


def run_one(spec: dict) -> dict:
    import agent_task
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(spec["threads"])
    name, rl = spec["config"], spec["rl"]
    tokenizer = agent_task.build_tokenizer()
    policy = AutoModelForCausalLM.from_pretrained(spec["sft_path"])
    before = evaluate(policy, tokenizer, rl)
    start = time.perf_counter()
    trainer = (grpo_trainer if name == "grpo" else ppo_trainer)(spec, tokenizer, policy)
    trainer.train()
    seconds = time.perf_counter() - start
    key = "reward" if name == "grpo" else "objective/scores/environment"  # PPO's own also has the EOS penalty
    scores = [round(float(h[key]), 4) for h in trainer.state.log_history if key in h]
    # GRPO logged "reward" 8 times in its 16 steps (128 games) here, PPO once per update (8 of 16 games).
    return {
        "config": name, "seed": spec["seed"], "before": before, "after": evaluate(policy, tokenizer, rl),
        "scores": scores, "episodes_per_update": rl["per_device_train_batch_size"] * rl["gradient_accumulation_steps"],
        "seconds": round(seconds, 2), "rl": rl, "sft": spec["sft"], "smoke": spec["smoke"],
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
    }


def episodes_to_reach(row: dict, level: float) -> int | None:
    """Episodes until an update's mean reward first reached `level` (None: never)."""
    for update, score in enumerate(row["scores"], 1):
        if score >= level:
            return update * row["episodes_per_update"]
    return None


def table(rows: list[dict]) -> str:
    levels = " | ".join(f"episodes to {level}" for level in SUCCESS_LEVELS)
    lines = [f"| config | seeds | success, greedy | success, sampled | guesses, sampled | {levels} | "
             "last 3 updates' reward | seconds/run |", "|---" * (7 + len(SUCCESS_LEVELS)) + "|"]
    for name in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == name]

        def pair(protocol: str, key: str, mine=mine) -> str:
            return (f"{mean_se([r['before'][protocol][key] for r in mine])} → "
                    f"{mean_se([r['after'][protocol][key] for r in mine])}")

        reach = " | ".join(
            ", ".join(str(episodes_to_reach(r, level) or "never") for r in mine) for level in SUCCESS_LEVELS)
        late = mean_se([statistics.mean(r["scores"][-3:]) for r in mine])
        seconds = statistics.mean(r["seconds"] for r in mine)
        lines.append(f"| {name} | {len(mine)} | {pair('greedy', 'success')} | {pair('sampled', 'success')} | "
                     f"{pair('sampled', 'guesses')} | {reach} | {late} | {seconds:.0f} |")
    return "\n".join(lines)


def main() -> None:
    results = os.path.join(HERE, "agent_credit_consistent.jsonl")
    parser = run_arguments(__doc__, results, "/tmp/trl_ppo_agent_credit", RL["updates"])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=DEFAULT_CONFIGS)
    parser.add_argument("--smoke", action="store_true", help="Tiny SFT, 1 update, 1 seed, every config.")
    parser.add_argument("--learning_rate", type=float, default=None, help=f"Default {RL['learning_rate']}.")
    parser.add_argument("--temperature", type=float, default=None, help=f"Default {RL['temperature']}.")
    cli = parser.parse_args()
    if serve_worker(cli.worker, run_one):
        return
    if cli.report:
        with open(cli.results) as lines:
            print(table([row for row in map(json.loads, lines) if row["smoke"] == cli.smoke]))
        return
    import agent_task

    rl, sft = (dict(SMOKE_RL), SMOKE_SFT) if cli.smoke else (dict(RL), SFT)
    rl["updates"] = cli.updates or rl["updates"]
    rl["learning_rate"] = cli.learning_rate or rl["learning_rate"]
    rl["temperature"] = cli.temperature or rl["temperature"]
    start = time.perf_counter()
    sft_path = game.train_sft(agent_task.build_tokenizer(), sft, cli.output_dir, log=log)
    log(f"SFT policy in {sft_path} ({time.perf_counter() - start:.0f}s)")
    spec = dict(rl=rl, sft=dataclasses.asdict(sft), sft_path=sft_path, output_dir=cli.output_dir, smoke=cli.smoke,
                threads=cli.threads)

    def describe(row: dict) -> str:
        b, a = row["before"]["sampled"], row["after"]["sampled"]
        return (f"sampled success {b['success']:.2f} -> {a['success']:.2f}, rewards per update {row['scores']}, "
                f"{row['seconds']:.0f}s")

    seeds = cli.seeds[:1] if cli.smoke else cli.seeds
    rows = run_seeds(spec, seeds, cli.configs, CONFIGS, cli.results, __file__, describe)
    print(table(rows))


if __name__ == "__main__":
    main()

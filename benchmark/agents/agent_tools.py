"""Agents: a calculator tool. A learning benchmark where the tool matters: PPO with a tool against PPO without it,
and TRL 1.12's GRPO trainer with the same tool as the field's reference point; offline, on the CPU.

    python benchmark/agents/agent_tools.py                 # 3 configs x seeds 0 1 2: ~7.5 min, + ~3 min of SFT once
    python benchmark/agents/agent_tools.py --smoke         # CI form: tiny SFT, 1 update, 1 seed (about a minute)
    python benchmark/agents/agent_tools.py --report        # the table of the rows already in --results

The task (`agent_task.py`): "What is A * B?" for two-digit A and B; reward 1.0 when the last integer of the
model's final turn is exactly A * B, else 0.0. The tool: `multiply(a, b)`. The tokenizer is
`trl_ppo.agents.tiny_chat.build_tool_tokenizer()` (byte-level, Qwen/Hermes-style `<tool_call>{json}</tool_call>`)
with a short tools' system block ("Tools: multiply(a, b)", `agent_task.TOOLS_BLOCK`). A tiny Qwen2 (128 wide,
2 layers) is trained from scratch by SFT (cached in `--output_dir` under a name made of its settings, so every
config and seed starts from the same weights) on conversations rendered with `tools=[multiply]`: 30% call the
tool and copy its answer, 70% answer at once with a guess of the right size. A model this small cannot multiply
in its head: without the tool it can only be lucky.

Configs, each run (one config, one seed) in a fresh process, same SFT start, episodes and seeds:
* `ppo+tools`: trl_ppo's `PPOTrainer(..., tools=[multiply])`, `max_turns=3`, chat-message prompts, `lam=1.0`
  (`-lam0.95`: trl_ppo's default λ, with which one seed of three stopped calling the tool; `-turn-lam0.95`: that λ
  with turn-level GAE, `gae_level="turn"`, which applies it once per turn instead of once per token);
* `ppo-no-tools`: trl_ppo without tools (`max_turns=1`), the same prompt ids (the tools' system block shown, so
  the start is the same policy) but a tool call is never answered;
* `grpo+tools`: TRL 1.12's `GRPOTrainer(..., tools=[multiply])`, `max_tool_calling_iterations=2` (3 turns of
  the model at most, as `max_turns=3`), G = 4 completions per prompt. GRPO is a different algorithm:
  group-relative advantages, no critic, TRL's defaults otherwise (`beta=0.0`: no KL penalty, `loss_type="dapo"`).

Measured: on `--held_out` problems never trained on, episodes played by trl_ppo's turn loop (the tool answered for
the `+tools` configs, one turn for `ppo-no-tools`), greedy and sampled at the training temperature (one episode
per problem, torch seed 0), before (the SFT policy) and after training:
success rate, tool-call rate, success among episodes that called the tool; training seconds (trainer set-up and
`train()`). One JSON line per run appended to `--results`; a Markdown table (mean ± s.e. over seeds) printed.
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
import agent_task as task  # noqa: E402
from learning import CPU_RUN, log, run_arguments, run_seeds, serve_worker  # noqa: E402

# name -> changes to `RL`. The first three run by default; the `-lam0.95` ones are PPO with GAE's default λ.
CONFIGS: dict[str, dict] = {
    "ppo+tools": {},
    "ppo-no-tools": {},
    "grpo+tools": {},
    "ppo+tools-lam0.95": {"lam": 0.95},
    "ppo-no-tools-lam0.95": {"lam": 0.95},
    "ppo+tools-turn-lam0.95": {"lam": 0.95, "gae_level": "turn"},  # turn-level GAE (issue 35): λ once per turn
}
DEFAULT_CONFIGS = list(CONFIGS)[:3]
RL = dict(  # shared by every run: `updates` x `batch` episodes
    updates=16,
    per_device_train_batch_size=8,
    gradient_accumulation_steps=2,  # 16 episodes per update
    num_ppo_epochs=2,  # GRPO's `num_iterations` (its μ)
    learning_rate=3e-4,
    temperature=0.7,
    response_length=160,  # the whole episode after the prompt: a call (~65), the answer (~58), the reply (~20)
    max_turns=3,
    max_tool_response_length=16,
    num_generations=4,  # GRPO only: completions per prompt
    lam=1.0,  # PPO only: GAE's λ (see `ppo_trainer`)
    gae_level="token",  # PPO only: GAE over model tokens, or over turns ('turn')
)
SFT = task.SFTSettings()
SMOKE_RL = dict(RL, updates=1, per_device_train_batch_size=4, gradient_accumulation_steps=1, num_ppo_epochs=1)
SMOKE_SFT = task.SFTSettings(hidden_size=16, num_layers=1, num_heads=2, copy_steps=1, steps=1, batch_size=4)
NUM_PROMPTS = 2000  # RL prompts, drawn from the SFT pool, never from the held-out problems


# ----------------------------------------------------------------------------------------------- one run
def uses_tools(config: str) -> bool:
    return not config.startswith("ppo-no-tools")


def common_args(spec: dict) -> dict:
    rl = spec["rl"]
    return dict(
        output_dir=os.path.join(spec["output_dir"], "runs", f"{spec['config']}-{spec['seed']}"),
        per_device_train_batch_size=rl["per_device_train_batch_size"],
        gradient_accumulation_steps=rl["gradient_accumulation_steps"],
        learning_rate=rl["learning_rate"],
        temperature=rl["temperature"],
        seed=spec["seed"],
        **CPU_RUN,
    )


def ppo_trainer(spec: dict, tokenizer, policy, dataset_rows: list[tuple[int, int]], reward):
    """trl_ppo's PPOTrainer: with the tool (chat-message prompts) or without it (the same prompts as ids)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification

    from trl_ppo import PPOConfig, PPOTrainer

    rl, run, tools = spec["rl"], f"{spec['config']}-{spec['seed']}", uses_tools(spec["config"])
    batch = rl["per_device_train_batch_size"] * rl["gradient_accumulation_steps"]
    config = PPOConfig(
        **common_args(spec),
        total_episodes=batch * rl["updates"],
        num_ppo_epochs=rl["num_ppo_epochs"],
        response_length=rl["response_length"],
        max_turns=rl["max_turns"] if tools else 1,
        max_tool_response_length=rl["max_tool_response_length"],
        stop_token="eos",
        missing_eos_penalty=1.0,
        # λ = 1: the final score reaches the first token (the decision to call the tool) undecayed, while the critic
        # is still untrained. With the default 0.95 it reaches it x 0.95^85 (a call and a reply are ~85 model
        # tokens) and whitening makes that advantage negative: one seed of three stopped calling (RESULTS.md).
        lam=rl["lam"],
        gae_level=rl.get("gae_level", "token"),
        local_rollout_forward_batch_size=batch,
        num_sample_generations=0,
        trajectory_dir=spec.get("trajectory_dir") and os.path.join(spec["trajectory_dir"], run),
    )
    columns = {"product": [a * b for a, b in dataset_rows]}
    if tools:
        columns["prompt"] = [task.prompt_messages(a, b) for a, b in dataset_rows]
    else:
        columns["input_ids"] = [task.prompt_ids(tokenizer, a, b) for a, b in dataset_rows]
    value_model = AutoModelForSequenceClassification.from_pretrained(spec["sft_path"], num_labels=1)
    torch.manual_seed(spec["seed"])  # the value head starts near 0, drawn from the seed
    torch.nn.init.normal_(value_model.score.weight, std=value_model.config.initializer_range)
    return PPOTrainer(
        args=config, processing_class=tokenizer, model=policy, ref_model=None, value_model=value_model,
        reward_model=[reward], train_dataset=Dataset.from_dict(columns),
        tools=[task.multiply] if tools else None,
    )


def grpo_trainer(spec: dict, tokenizer, policy, dataset_rows: list[tuple[int, int]], reward):
    """TRL 1.12's GRPOTrainer with the tool. One generation of `batch` episodes (batch / G prompts x G) serves
    `num_iterations` optimizer steps, so `updates x num_iterations` steps: PPO's episodes and optimizer steps."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    rl = spec["rl"]
    config = GRPOConfig(
        **common_args(spec),
        max_steps=rl["updates"] * rl["num_ppo_epochs"],
        num_generations=rl["num_generations"],
        num_iterations=rl["num_ppo_epochs"],
        max_completion_length=rl["response_length"],
        max_tool_calling_iterations=rl["max_turns"] - 1,
    )
    columns = {
        "prompt": [task.prompt_messages(a, b) for a, b in dataset_rows],
        "product": [a * b for a, b in dataset_rows],
    }
    return GRPOTrainer(
        model=policy, reward_funcs=[reward], args=config, train_dataset=Dataset.from_dict(columns),
        processing_class=tokenizer, tools=[task.multiply],
    )


def curve(log_history: list[dict], config: str) -> dict[str, list[float]]:
    """Per update: the mean score and tool calls per episode of the sampled episodes, as each trainer logs them."""
    score, calls = ("reward", "tools/call_frequency") if config == "grpo+tools" else (
        "objective/scores", "env/tool_calls_mean")
    return {
        "scores": [round(float(h[score]), 4) for h in log_history if score in h],
        "tool_calls": [round(float(h[calls]), 4) for h in log_history if calls in h],
    }


def evaluate(policy, tokenizer, held_out, evaluation: dict, temperature: float) -> dict:
    """The held-out episodes greedy, and sampled at the training temperature (one per problem, seed 0)."""
    return {
        "greedy": task.evaluate(policy, tokenizer, held_out, **evaluation),
        "sampled": task.evaluate(policy, tokenizer, held_out, **evaluation, temperature=temperature, seed=0),
    }


def run_one(spec: dict) -> dict:
    """Train one config on one seed in this process; -> its result row."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(spec["threads"])
    name, rl = spec["config"], spec["rl"]
    tokenizer = task.build_tokenizer()
    held_out, pool = task.split_problems()
    held_out = held_out[: spec["held_out"]]
    tools = uses_tools(name)
    evaluation = dict(tools=tools, max_turns=rl["max_turns"], budget=rl["response_length"])
    policy = AutoModelForCausalLM.from_pretrained(spec["sft_path"])
    before = evaluate(policy, tokenizer, held_out, evaluation, rl["temperature"])
    make = grpo_trainer if name == "grpo+tools" else ppo_trainer
    scored = []  # the episodes each trainer's reward scored: both get the same number

    def product_reward(prompts, completions, product, **columns):
        scored.append(len(completions))
        return task.product_reward(prompts, completions, product)

    start = time.perf_counter()
    trainer = make(spec, tokenizer, policy, pool[: spec["prompts"]], product_reward)
    trainer.train()
    seconds = time.perf_counter() - start
    after = evaluate(policy, tokenizer, held_out, evaluation, rl["temperature"])
    return {
        "config": name,
        "trainer": "trl (TRL 1.12 GRPO)" if name == "grpo+tools" else "trl_ppo",
        "seed": spec["seed"],
        "before": before,
        "after": after,
        **curve(trainer.state.log_history, name),
        "episodes": sum(scored),
        "seconds": round(seconds, 2),
        "threads": spec["threads"],
        "held_out": len(held_out),
        "rl": rl,
        "sft": spec["sft"],
        "smoke": spec["smoke"],
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }


# -------------------------------------------------------------------------------------------------- report
def mean_se(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    se = statistics.stdev(values) / len(values) ** 0.5
    return f"{statistics.mean(values):.3f} ± {se:.3f}"


def table(rows: list[dict]) -> str:
    """Per config, mean ± s.e. over seeds, before → after: success and tool-call rate, greedy and sampled."""
    lines = [
        "| config | trainer | seeds | success, greedy | success, sampled | tool-call rate, greedy | tool-call rate, "
        "sampled | success when calling, sampled | seconds/run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == name]

        def pair(protocol: str, key: str, mine=mine) -> str:
            before = mean_se([r["before"][protocol][key] for r in mine])
            return f"{before} → {mean_se([r['after'][protocol][key] for r in mine])}"

        seconds = statistics.mean(r["seconds"] for r in mine)
        lines.append(
            f"| {name} | {mine[0]['trainer']} | {len(mine)} | {pair('greedy', 'success')} | "
            f"{pair('sampled', 'success')} | {pair('greedy', 'tool_call_rate')} | "
            f"{pair('sampled', 'tool_call_rate')} | {pair('sampled', 'success_when_calling')} | {seconds:.0f} |"
        )
    return "\n".join(lines)


def report(path: str, smoke: bool) -> None:
    with open(path) as lines:
        rows = [row for row in map(json.loads, lines) if row["smoke"] == smoke]
    order = list(CONFIGS)
    rows.sort(key=lambda row: order.index(row["config"]) if row["config"] in order else len(order))
    print(table(rows))


# --------------------------------------------------------------------------------------------- orchestration
def parse_args():
    parser = run_arguments(__doc__, os.path.join(HERE, "agent_tools.jsonl"), "/tmp/trl_ppo_agent_tools", RL["updates"])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=DEFAULT_CONFIGS)
    parser.add_argument("--held_out", type=int, default=100, help="Held-out problems evaluated before and after.")
    parser.add_argument("--smoke", action="store_true", help="CI form: tiny SFT, 1 update, 1 seed, every config.")
    parser.add_argument("--trajectory_dir", help="Write each PPO run's episodes to DIR/<config>-<seed> "
                        "(`trl-ppo trajectories view` draws them).")  # fmt: skip
    return parser.parse_args()


def main() -> None:
    cli = parse_args()
    if serve_worker(cli.worker, run_one):
        return
    if cli.report:
        report(cli.results, cli.smoke)
        return
    import torch

    torch.set_num_threads(cli.threads)
    rl, sft = (dict(SMOKE_RL), SMOKE_SFT) if cli.smoke else (dict(RL), SFT)
    rl["updates"] = cli.updates or rl["updates"]
    seeds, held_out = (cli.seeds[:1], 4) if cli.smoke else (cli.seeds, cli.held_out)
    start = time.perf_counter()
    sft_path = task.train_sft(task.build_tokenizer(), task.split_problems()[1], sft, cli.output_dir, log=log)
    log(f"SFT policy in {sft_path} ({time.perf_counter() - start:.0f}s)")
    spec = dict(rl=rl, sft=dataclasses.asdict(sft), sft_path=sft_path, output_dir=cli.output_dir, smoke=cli.smoke,
                trajectory_dir=cli.trajectory_dir)  # fmt: skip
    spec.update(threads=cli.threads, prompts=NUM_PROMPTS, held_out=held_out)

    def describe(row: dict) -> str:
        b, a = row["before"]["sampled"], row["after"]["sampled"]
        return (f"sampled: success {b['success']:.2f} -> {a['success']:.2f}, tool calls {b['tool_call_rate']:.2f} -> "
                f"{a['tool_call_rate']:.2f}, {row['seconds']:.0f}s")

    rows = run_seeds(spec, seeds, cli.configs, CONFIGS, cli.results, __file__, describe)
    print(f"\n{len(rows)} runs appended to {cli.results}\n")
    print(table(rows))
    if len(rows) < len(cli.configs) * len(seeds):
        sys.exit(1)


if __name__ == "__main__":
    main()

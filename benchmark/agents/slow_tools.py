"""Agents with slow tools (issue 54, part 4): the SmolLM2-135M tool task of `smollm2_tool.py` ("(a * b) + c" with
`multiply` and `add`, from the same cached warm start), each tool call taking `--delays` seconds more (a sleep
standing in for a sandbox or an HTTP call). Every cell trains `--updates` updates of `--batch_size` episodes in a
process of its own; the row records the training's wall and CPU seconds (the whole process's, every thread's), the
episodes per wall-second and per CPU-second, and the process's peak RSS.

    OMP_NUM_THREADS=1 python benchmark/agents/slow_tools.py                       # every config x every delay
    OMP_NUM_THREADS=1 python benchmark/agents/slow_tools.py --configs ppo ppo-lockstep --delays 0 1.0

Configs: 'ppo' (PPO, turn-level GAE, a value head; episodes played by the continuous engine, the default),
'ppo-lockstep' (the same with `agent_rollout='lockstep'`, the loop before issue 54), 'grpo' (trl_ppo's GRPO, groups
of 4, continuous), 'grpo-sampler' (the same with `use_sampler_logprobs`: no policy forward after sampling),
'trl_grpo' (TRL 1.12's GRPOTrainer, the same tools, template, group size and budget). The cells run one after
another (one core each, nothing else running is the intended setting); rows go to `--out`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
OUT = os.path.join(HERE, "slow_tools.jsonl")
CONFIGS = {  # config -> (smollm2_tool.py's estimator, the PPOConfig fields it sets; None: TRL's trainer)
    "ppo": ("gae", {"agent_rollout": "continuous"}),
    "ppo-lockstep": ("gae", {"agent_rollout": "lockstep"}),
    "grpo": ("grpo", {"agent_rollout": "continuous"}),
    "grpo-sampler": ("grpo", {"agent_rollout": "continuous", "use_sampler_logprobs": True}),
    "trl_grpo": ("trl_grpo", None),
}


def slowed(tool, delay: float):
    """`tool` taking `delay` seconds more per call (its name, signature and docstring kept: its schema is the same)."""

    @functools.wraps(tool)
    def call(*args, **kwargs):
        time.sleep(delay)
        return tool(*args, **kwargs)

    return call


def run_cell(config: str, delay: float, updates: int, batch_size: int, seed: int) -> dict:
    """Train one cell in this process -> its row (without the machine's fields)."""
    import smollm2_tool as bench
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    estimator, fields = CONFIGS[config]
    output_dir = os.path.join(ROOT, "runs", "slow_tools", f"{config}-delay{delay:g}-{time.time_ns()}")
    args = bench.parse_args(["--estimator", estimator, "--updates", str(updates), "--batch_size", str(batch_size),
                             "--seed", str(seed), "--work_dir", output_dir])  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    args.warm_start_settings = bench.task.cached_warm_start(args.model, tokenizer, args.warm_start)
    bench.task.TOOLS = tuple(slowed(tool, delay) for tool in bench.task.TOOLS)
    if fields is not None:
        make_config = bench.agent.config
        bench.agent.config = lambda a: _with_fields(make_config(a), fields)
    wall, cpu = time.perf_counter(), time.process_time()
    train = bench.train_trl_grpo if estimator == "trl_grpo" else bench.train_trl_ppo
    _, curve, _ = train(args, tokenizer)  # (model, success curve, critic curves)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    episodes = updates * batch_size
    return {
        "config": config, "delay": delay, "updates": updates, "batch_size": batch_size, "seed": seed,
        "episodes": episodes, "train_wall_s": round(wall, 1), "train_cpu_s": round(cpu, 1),
        "episodes_per_wall_s": round(episodes / wall, 4), "episodes_per_cpu_s": round(episodes / cpu, 4),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "training_success": curve, "warm_start_settings": args.warm_start_settings,
    }  # fmt: skip


def _with_fields(config, fields: dict):
    for name, value in fields.items():
        setattr(config, name, value)
    return config


def machine() -> dict:
    import platform

    import torch
    import transformers

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    return {"commit": commit.stdout.strip(), "cpu": cpu or platform.processor(), "cores": os.cpu_count(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "torch": torch.__version__,
            "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d")}  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--delays", nargs="+", type=float, default=[0.0, 0.2, 1.0])
    parser.add_argument("--updates", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--cell", nargs=2, metavar=("CONFIG", "DELAY"), help=argparse.SUPPRESS)
    parser.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.prepare:
        import smollm2_tool as bench
        from transformers import AutoTokenizer

        model = bench.parse_args([]).model
        bench.task.cached_warm_start(model, AutoTokenizer.from_pretrained(model), bench.task.DEFAULT_OUTPUT)
        return
    if args.cell:  # a child: one cell, its row printed last
        print(json.dumps(run_cell(args.cell[0], float(args.cell[1]), args.updates, args.batch_size, args.seed)))
        return
    # the warm start made (once) before any cell, so that no cell's figures include it
    subprocess.run([sys.executable, os.path.abspath(__file__), "--prepare"], check=True)
    where = machine()
    for delay in args.delays:
        for config in args.configs:
            command = [sys.executable, os.path.abspath(__file__), "--cell", config, str(delay), "--updates",
                       str(args.updates), "--batch_size", str(args.batch_size), "--seed", str(args.seed)]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{config} at {delay} s failed:\n{done.stderr[-3000:]}")
            row = json.loads(done.stdout.strip().splitlines()[-1]) | where
            with open(args.out, "a", encoding="utf-8") as out:
                out.write(json.dumps(row) + "\n")
            print(f"{config:13s} delay {delay:4.1f} s: {row['episodes_per_wall_s']:.3f} episodes/wall-s, "
                  f"{row['episodes_per_cpu_s']:.3f} episodes/CPU-s, peak RSS {row['peak_rss_gb']} GB", flush=True)


if __name__ == "__main__":
    main()

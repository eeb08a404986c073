"""Where the memory of `make demo-agent` goes (issue 54, part 3): the demo's trainer (SmolLM2-135M-Instruct from
the cached tool warm start, PPO with a value head, 8 episodes per update) run for `--updates` updates, then the
held-out evaluation on `--held_out` problems, with the process's RSS measured per phase: when a phase starts, the
memory freed before it is handed back to the system (`malloc_trim`), its RSS read and the peak reset
(`/proc/self/clear_refs`, Linux); the peak (`VmHWM`) is read when it ends.

    OMP_NUM_THREADS=1 python benchmark/agents/agent_memory.py --updates 2 --held_out 25

Phases: `load` (the warm start and the trainer built: reference copy, value head, optimizer), `rollout` (sampling
and the no-grad log-probs and values), `score`, `update` (the PPO epochs), `evaluate` (greedy held-out episodes,
`smollm2_tool_agent.evaluate`). The row (RSS at the start and peak per phase, in GB, and its CPU seconds; the
largest peak; the commit) goes to `--out`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import subprocess
import sys
import time
from contextlib import contextmanager

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.join(ROOT, "examples", "scripts")]
OUT = os.path.join(HERE, "agent_memory.jsonl")


def rss_gb(field: str) -> float:
    """`VmRSS` (now) or `VmHWM` (the peak since the last reset) of this process, in GB."""
    return int(re.search(field + r":\s+(\d+)", open("/proc/self/status").read()).group(1)) / 2**20


@contextmanager
def phase(peaks: dict, name: str):
    """Record the RSS when the block starts and its peak during the block under `name` (the largest over
    repeated blocks), and its CPU seconds (summed over repeated blocks). Memory freed before the block is first
    handed back to the system (`malloc_trim`), so that the start is what is alive, not what the allocator kept."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the peak starts again from the current RSS
    start, cpu = rss_gb("VmRSS"), time.process_time()
    try:
        yield
    finally:
        old = peaks.get(name, {"start": 0.0, "peak": 0.0, "cpu_s": 0.0})
        peaks[name] = {"start": round(max(old["start"], start), 2), "peak": round(max(old["peak"], rss_gb("VmHWM")), 2),
                       "cpu_s": round(old["cpu_s"] + time.process_time() - cpu, 1)}  # fmt: skip


def measured(peaks: dict, name: str, method):
    def call(*args, **kwargs):
        with phase(peaks, name):
            return method(*args, **kwargs)

    return call


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=2)
    parser.add_argument("--held_out", type=int, default=25)
    parser.add_argument("--agent_rollout", default=None, help="'continuous' or 'lockstep' (default: the config's)")
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--note", default="")
    args = parser.parse_args(argv)
    import smollm2_tool_agent as agent
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    demo = agent.parse_args(["--updates", str(args.updates), "--output_dir", f"/tmp/agent_memory_{time.time_ns()}"])
    tokenizer = AutoTokenizer.from_pretrained(demo.model, padding_side="left")
    agent.task.cached_warm_start(demo.model, tokenizer, demo.warm_start)
    peaks = {}
    with phase(peaks, "load"):
        policy = agent.load_policy(demo.warm_start)
        trainer = agent.trainer_for(demo, policy, tokenizer)
        if args.agent_rollout is not None:
            trainer.args.agent_rollout = args.agent_rollout
    for name, attribute in (("rollout", "collect_rollout"), ("score", "score"), ("update", "ppo_update")):
        setattr(trainer, attribute, measured(peaks, name, getattr(trainer, attribute)))
    trainer.train()
    held_out = agent.task.split_problems()[0][: args.held_out]
    with phase(peaks, "evaluate"):
        result = agent.evaluate(policy, tokenizer, held_out, demo)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    row = {"rss_gb": peaks, "peak_gb": max(phase["peak"] for phase in peaks.values()),
           "updates": args.updates, "held_out": args.held_out, "success": result["success"],
           "agent_rollout": getattr(trainer.args, "agent_rollout", "lockstep"), "note": args.note,
           "commit": commit.stdout.strip(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    with open(args.out, "a", encoding="utf-8") as out:
        out.write(json.dumps(row) + "\n")
    print(json.dumps(row))


if __name__ == "__main__":
    main()

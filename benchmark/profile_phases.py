"""Seconds per update spent in each phase of trl_ppo's loop (sampling, the rollout's no-grad forwards, scoring,
advantages, the PPO update), averaged over all updates including the warm-up. For finding what to speed up next;
notes in benchmark/NOTES.md.

    python benchmark/profile_phases.py --shape 160m --precision bf16 --trl_ppo_flags "train_forward_batch_size=64"
"""

import collections
import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_ppo  # noqa: E402

from trl_ppo import PPOTrainer  # noqa: E402

PHASES = ("_sample", "add_logprobs_and_values", "score", "compute_advantages", "ppo_update", "_end_update")
seconds = collections.defaultdict(list)


def timed(name: str) -> None:
    method = getattr(PPOTrainer, name)

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = method(*args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds[name].append(time.perf_counter() - start)
        return result

    setattr(PPOTrainer, name, wrapper)


if __name__ == "__main__":
    for phase in PHASES:
        timed(phase)
    sys.argv[1:1] = ["--worker", "trl_ppo"]
    bench_ppo.main()
    print("phase seconds per update (first = warm-up):")
    for phase in PHASES:
        times = seconds[phase]
        steady = times[1:] or times
        print(f"  {phase:26s} first {times[0]:7.3f}  steady {sum(steady) / len(steady):7.3f}")

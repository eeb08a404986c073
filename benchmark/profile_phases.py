"""Seconds per update spent in each phase of trl_ppo's loop (sampling, the rollout's no-grad forwards, scoring,
advantages, the PPO update), averaged over all updates including the warm-up. For finding what to speed up next;
notes in benchmark/NOTES.md.

    python benchmark/profile_phases.py --shape 160m --precision bf16 --trl_ppo_flags "train_forward_batch_size=64"
    PROFILE_UPDATE=3 python benchmark/profile_phases.py ...   # also: torch.profiler's top kernels of update 3
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
PROFILE_UPDATE = int(os.environ.get("PROFILE_UPDATE", "0"))  # 0: no torch.profiler
seconds = collections.defaultdict(list)
profiler = None


def profile_boundaries(name: str) -> None:
    """Start torch.profiler when update PROFILE_UPDATE starts sampling, print its table when its update ends."""
    global profiler
    if name == "_sample" and len(seconds["_sample"]) == PROFILE_UPDATE - 1:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(activities=activities)
        profiler.__enter__()


def timed(name: str) -> None:
    method = getattr(PPOTrainer, name)

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        if PROFILE_UPDATE:
            profile_boundaries(name)
        start = time.perf_counter()
        result = method(*args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds[name].append(time.perf_counter() - start)
        global profiler
        if profiler is not None and name == "ppo_update":
            profiler.__exit__(None, None, None)
            sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            print(profiler.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=70))
            profiler = None
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

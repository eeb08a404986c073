"""Seconds per update spent in each phase of trl_ppo's loop (sampling, the rollout's no-grad forwards, scoring,
advantages, the PPO update), averaged over all updates including the warm-up. For finding what to speed up next;
notes in benchmark/NOTES.md.

    python benchmark/speed/profile_phases.py --shape 160m --precision bf16 --trl_ppo_flags "train_forward_batch_size=64"
    PROFILE_UPDATE=3 python benchmark/speed/profile_phases.py ...   # also: torch.profiler's top kernels of update 3
"""

import collections
import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_ppo  # noqa: E402

from trl_ppo import PPOTrainer, rollout  # noqa: E402

# (where it is looked up, name): the sampling and the no-grad passes are functions of `rollout`, called from there.
PHASES = (
    (rollout, "sample_responses"),
    (rollout, "add_logprobs_and_values"),
    (PPOTrainer, "score"),
    (PPOTrainer, "compute_rewards"),
    (PPOTrainer, "compute_advantages"),
    (PPOTrainer, "ppo_update"),
    (PPOTrainer, "_end_update"),
)
PROFILE_UPDATE = int(os.environ.get("PROFILE_UPDATE", "0"))  # 0: no torch.profiler
seconds = collections.defaultdict(list)
profiler = None


def profile_boundaries(name: str) -> None:
    """Start torch.profiler when update PROFILE_UPDATE starts sampling, print its table when its update ends."""
    global profiler
    if name == "sample_responses" and len(seconds["sample_responses"]) == PROFILE_UPDATE - 1:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(activities=activities)
        profiler.__enter__()


def timed(owner, name: str) -> None:
    method = getattr(owner, name)

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

    setattr(owner, name, wrapper)


if __name__ == "__main__":
    for owner, phase in PHASES:
        timed(owner, phase)
    sys.argv[1:1] = ["--worker", "trl_ppo"]
    bench_ppo.main()
    print("phase seconds per update (first = warm-up):")
    for _, phase in PHASES:
        times = seconds[phase]
        steady = times[1:] or times
        print(f"  {phase:26s} first {times[0]:7.3f}  steady {sum(steady) / len(steady):7.3f}")

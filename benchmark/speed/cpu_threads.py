"""The default job's wall time with torch's own thread count against `trl-ppo`'s choice (`trl_ppo/cpu_threads.py`:
the cores the load average leaves free), run alternately on this machine as it is now (loaded or idle):

    python benchmark/speed/cpu_threads.py [--repeats 2] [--total_episodes 640]

"torch default" pins OMP_NUM_THREADS to torch's own thread count (what a run used before the choice existed);
"trl-ppo's choice" leaves OMP_NUM_THREADS unset. Prints one line per run and the medians."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def one_run(threads: int | None, total_episodes: int) -> float:
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "trl_ppo", "--total_episodes", str(total_episodes),
                   "--num_sample_generations", "0", "--output_dir", os.path.join(folder, "run")]
        start = time.perf_counter()
        subprocess.run(command, env=env, check=True, capture_output=True)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--total_episodes", type=int, default=640)
    args = parser.parse_args()
    import torch

    default = torch.get_num_threads()
    times: dict[str, list[float]] = {"torch default": [], "trl-ppo's choice": []}
    for _ in range(args.repeats):
        for name, threads in (("torch default", default), ("trl-ppo's choice", None)):
            load = os.getloadavg()[0]
            seconds = one_run(threads, args.total_episodes)
            times[name].append(seconds)
            print(f"{name:>17}: {seconds:6.1f} s  (load {load:.1f} on {os.cpu_count()} cores at the start)", flush=True)
    for name, values in times.items():
        print(f"median {name:>17}: {statistics.median(values):6.1f} s over {len(values)} runs")


if __name__ == "__main__":
    main()

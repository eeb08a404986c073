"""Is the embedded default job (`make demo`) a healthy PPO run? Runs it for several seeds and prints, per seed,
the wall time, the CPU time (user + system, all threads: on a shared machine the steadier figure) and the
metrics the README's "what healthy values look like" table reads, first logged value -> last (and the largest
`policy/approxkl_avg` / `policy/clipfrac_avg` seen).

    python benchmark/learning/default_job.py --seeds 1 2 3 [--jsonl out.jsonl] [-- extra trl-ppo flags]

Each run is `python -m trl_ppo --output_dir <tmp> --seed <s> <extra flags>` in its own process, one after
another; the metrics come from the run's `trainer_state.json`.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmark/: rows.py
from rows import append_row  # noqa: E402

SERIES = {
    "score": "objective/scores",
    "kl": "objective/kl",
    "value_loss": "loss/value_avg",
    "missing_stop": "val/missing_stop_token_frac",
    "entropy": "objective/entropy",
}
PEAKS = {"approxkl_max": "policy/approxkl_avg", "clipfrac_max": "policy/clipfrac_avg"}


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(seed: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        output_dir = os.path.join(scratch, "run")
        command = [sys.executable, "-m", "trl_ppo", "--output_dir", output_dir, "--seed", str(seed), *extra]
        start, cpu_start = time.perf_counter(), children_cpu_seconds()
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        seconds, cpu = time.perf_counter() - start, children_cpu_seconds() - cpu_start
        if done.returncode != 0:
            raise SystemExit(f"seed {seed} failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
        with open(os.path.join(output_dir, "trainer_state.json"), encoding="utf-8") as handle:
            logged = [e for e in json.load(handle)["log_history"] if "objective/scores" in e]
    row = {"seed": seed, "seconds": round(seconds, 1), "cpu_seconds": round(cpu, 1), "logs": len(logged),
           "load_average_1min": round(os.getloadavg()[0], 2),
           "eps": round(logged[-1]["eps"], 1)}  # episodes per wall-second of the updates (start-up excluded)
    for name, key in SERIES.items():
        row[name] = [round(logged[0][key], 3), round(logged[-1][key], 3)]
    row["score_curve"] = [round(e["objective/scores"], 4) for e in logged]
    row["value_loss_peak"] = round(max(e["loss/value_avg"] for e in logged), 3)
    for name, key in PEAKS.items():
        row[name] = round(max(e[key] for e in logged), 4)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--jsonl", help="append one JSON line per run to this file")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="trl-ppo flags after `--`")
    args = parser.parse_args()
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    header = "  ".join(f"{name:>17}" for name in SERIES)
    print(f"seed  seconds  cpu_s  load  {header}  vloss_peak  approxkl_max  clipfrac_max")
    for seed in args.seeds:
        row = run_once(seed, extra)
        series = "  ".join(f"{row[n][0]:>7.3f} -> {row[n][1]:<7.3f}" for n in SERIES)
        print(
            f"{seed:>4}  {row['seconds']:>7}  {row['cpu_seconds']:>5}  {row['load_average_1min']:>4}  {series}  "
            f"{row['value_loss_peak']:>10}  {row['approxkl_max']:>12}  {row['clipfrac_max']:>12}",
            flush=True,
        )
        if args.jsonl:
            append_row(args.jsonl, {**row, "extra": extra})


if __name__ == "__main__":
    main()

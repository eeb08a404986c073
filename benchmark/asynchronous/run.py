"""Asynchronous PPO against the synchronous loop on the default job (`make demo`): episodes per wall-second of the
updates (`eps`, start-up excluded), wall-clock and CPU seconds of the whole process, and the learning, at
`max_staleness` 0, 1 and 2 with each `off_policy_correction`, with the default reward or behind a 0.5 s judge
(`slow_judge.py`: `--judge sync` a plain function, `--judge async` an `async` one). One `trl-ppo` process per run,
one run at a time (each run's trainer and its sampler process take a core each: `OMP_NUM_THREADS=1`); rows
appended to `--out`, rows already there skipped.

    OMP_NUM_THREADS=1 python benchmark/asynchronous/run.py --seeds 1 2 3 4 5 --out benchmark/asynchronous/table.jsonl
    OMP_NUM_THREADS=1 python benchmark/asynchronous/run.py --seeds 1 --judge async --cells sync stale1-decoupled \
        --out benchmark/asynchronous/table.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "learning")]
from default_job import run_once  # noqa: E402
from rows import append_row, has_row  # noqa: E402

CELLS = {  # name -> trl-ppo flags
    "sync": [],
    "stale1-decoupled": ["--max_staleness", "1", "--off_policy_correction", "decoupled"],
    "stale1-tis": ["--max_staleness", "1", "--off_policy_correction", "tis"],
    "stale2-decoupled": ["--max_staleness", "2", "--off_policy_correction", "decoupled"],
    "stale2-tis": ["--max_staleness", "2", "--off_policy_correction", "tis"],
    "stale2-none": ["--max_staleness", "2", "--off_policy_correction", "none"],
}
JUDGES = {"sync": "slow_sentiment", "async": "async_slow_sentiment"}  # --judge -> the function in slow_judge.py
KEY = ("cell", "judge", "seed")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--cells", nargs="+", choices=sorted(CELLS), default=list(CELLS))
    parser.add_argument("--judge", choices=sorted(JUDGES), help="score behind the 0.5 s judge, plain or async")
    parser.add_argument("--out", required=True)
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="more trl-ppo flags after `--`")
    args = parser.parse_args(argv)
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    for seed in args.seeds:
        for cell in args.cells:
            key = {"cell": cell, "judge": args.judge, "seed": seed}
            if has_row(args.out, key, KEY):
                continue
            judge = ["--reward_function", f"{HERE}/slow_judge.py:{JUDGES[args.judge]}"] if args.judge else []
            row = run_once(seed, CELLS[cell] + judge + extra)
            append_row(args.out, key | row | {"threads": os.environ.get("OMP_NUM_THREADS")})
            print(cell, args.judge or "", seed, row["eps"], "eps", row["seconds"], "s", row["cpu_seconds"], "CPU s",
                  "score", row["score"], flush=True)


if __name__ == "__main__":
    main()

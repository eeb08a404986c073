"""The table of the rows `run.py` wrote: per task and method, the start's and the final success (greedy and
sampled on held-out starts; mean ± sd over seeds), episodes to reach 0.8 per seed, and CPU seconds.

    python benchmark/credit/report.py benchmark/credit/calibration.jsonl
    python benchmark/credit/report.py rows.jsonl --best_lr "gae --gae_level turn"   # prints the rate table.sh uses

The best learning rate of a method is chosen on seed 0 over all tasks: the rate whose runs reached 0.8 on the most
tasks, then the fewest episodes to get there summed over tasks (a run that never did counts its whole budget).
"""

from __future__ import annotations

import argparse
import json
import statistics


def method(row: dict) -> str:
    return f"gae ({row['gae_level']})" if row["estimator"] == "gae" else row["estimator"]


def mean_sd(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def table(rows: list[dict]) -> str:
    lines = ["| task | method | seeds | lr | start greedy / sampled | final greedy | final sampled | episodes to 0.8 "
             "| CPU s |", "|---" * 9 + "|"]
    cells: dict[tuple, list[dict]] = {}
    for row in rows:
        cells.setdefault((row["task"], method(row), row["lr"]), []).append(row)
    for (task, name, lr), mine in sorted(cells.items()):
        def both(when: str, mine=mine) -> tuple[str, str]:
            return tuple(mean_sd([r[when][protocol] for r in mine]) for protocol in ("greedy", "sampled"))

        reach = ", ".join(str(r["episodes_to_0.8"] or "never") for r in mine)
        cpu = statistics.mean(r["cpu_seconds"] for r in mine)
        lines.append(f"| {task} | {name} | {len(mine)} | {lr:g} | {' / '.join(both('before'))} | "
                     f"{' | '.join(both('final'))} | {reach} | {cpu:.0f} |")
    return "\n".join(lines)


def best_lr(rows: list[dict], flags: str) -> float:
    """The learning rate of the method `flags` names (as sweep.sh spells it: "gae --gae_level turn", "rloo")."""
    words = flags.split()
    name = f"gae ({words[words.index('--gae_level') + 1]})" if words[0] == "gae" else words[0]
    by_lr: dict[float, list[dict]] = {}
    for row in rows:
        if method(row) == name and row["seed"] == 0:
            by_lr.setdefault(row["lr"], []).append(row)
    if not by_lr:
        raise SystemExit(f"no seed-0 rows of {name!r}: run the learning-rate sweep first")

    def rank(lr: float) -> tuple[int, int]:
        reached = [r["episodes_to_0.8"] for r in by_lr[lr]]
        budget = [r["updates"] * r["episodes_per_update"] for r in by_lr[lr]]
        return (-sum(e is not None for e in reached), sum(e if e is not None else b for e, b in zip(reached, budget)))

    return min(sorted(by_lr), key=rank)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rows", help="JSONL file of run.py rows")
    parser.add_argument("--best_lr", metavar="METHOD", help="print the best seed-0 learning rate of METHOD only")
    args = parser.parse_args(argv)
    with open(args.rows) as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    print(f"{best_lr(rows, args.best_lr):g}" if args.best_lr else table(rows))


if __name__ == "__main__":
    main()

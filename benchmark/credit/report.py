"""The table of the rows `run.py` wrote: per task and method, the start's and the final success (greedy and
sampled on held-out starts; mean ± sd over seeds), episodes to reach 0.8 per seed, and CPU seconds.

    python benchmark/credit/report.py benchmark/credit/calibration.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys


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


def main(path: str) -> None:
    with open(path) as lines:
        print(table([json.loads(line) for line in lines if line.strip()]))


if __name__ == "__main__":
    main(sys.argv[1])

"""The table and the learning curves of `run.py`'s rows: per cell and judge, the median episodes per wall-second of
the updates (`eps`) over the seeds, its ratio to the synchronous cell's median (same judge), the median wall and CPU
seconds of the whole process, and the final score (the last logged `objective/scores`) as mean, min and max over the
seeds; the synchronous cell's seed-to-seed range is what "within the spread" is read against; and how soon a run
gets to a score of 0.5 (the update, read off its logged curve between the points around it; and that in seconds of
the updates at the run's episodes/s), the median over the seeds. `--plot` draws the score curves (mean over seeds)
of the cells without a judge (a judge changes the timing, not the scores).

`--tool` reads the SmolLM2 tool task's rows instead (`benchmark/agents/smollm2_tool.py --max_staleness ...`): per
`max_staleness` and correction, the median episodes per wall-second of the training (its episodes over
`train_wall_seconds`) and its ratio to the synchronous cell's, the median training CPU seconds (the sampler process's
included), the training success of the last 4 updates (mean over them, then mean, min and max over the seeds), the
held-out success before and after (mean, min and max over the seeds), and the critic's explained variance over the
last 4 updates (where the rows record it); `--plot` draws each cell's training success per update (mean over its
seeds).

    python benchmark/asynchronous/report.py benchmark/asynchronous/table.jsonl --plot benchmark/asynchronous/curves.png
    python benchmark/asynchronous/report.py --tool benchmark/asynchronous/smollm2_tool.jsonl \
        --plot benchmark/asynchronous/smollm2_tool.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

LOG_EVERY = 10  # updates between the default job's logged points (`logging_steps`)
EPISODES_PER_UPDATE = 32  # the default job's batch
TARGET = 0.5  # the score "how soon" is read at


def load(path: str) -> dict[tuple, list[dict]]:
    """Rows grouped by (judge, cell), in the order they first appear."""
    groups = defaultdict(list)
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                row = json.loads(line)
                groups[(row["judge"] or "none", row["cell"])].append(row)
    return groups


def update_reaching(curve: list[float], target: float = TARGET) -> float:
    """The update at which a logged score curve first reaches `target`, linear between its points (inf: never)."""
    for i, score in enumerate(curve):
        if score >= target:
            if i == 0:
                return float(LOG_EVERY)
            before = curve[i - 1]
            return LOG_EVERY * (i + (target - before) / (score - before))
    return float("inf")


def table(groups: dict[tuple, list[dict]]) -> str:
    header = "| judge | cell | seeds | episodes/s (median) | x sync | wall s | CPU s | final score mean [min, max] "
    lines = [header + f"| update reaching {TARGET} | seconds to {TARGET} |", "|---" * 10 + "|"]
    for (judge, cell), rows in groups.items():
        eps = statistics.median(row["eps"] for row in rows)
        sync = groups.get((judge, "sync"))
        ratio = eps / statistics.median(row["eps"] for row in sync) if sync else float("nan")
        finals = [row["score"][1] for row in rows]
        wall, cpu = (statistics.median(row[key] for row in rows) for key in ("seconds", "cpu_seconds"))
        reach = [update_reaching(row["score_curve"]) for row in rows]
        seconds = [u * EPISODES_PER_UPDATE / row["eps"] for u, row in zip(reach, rows)]
        lines.append(
            f"| {judge} | {cell} | {len(rows)} | {eps:.0f} | {ratio:.2f} | {wall:.1f} | {cpu:.1f} | "
            f"{statistics.mean(finals):.3f} [{min(finals):.3f}, {max(finals):.3f}] | "
            f"{statistics.median(reach):.1f} | {statistics.median(seconds):.1f} |"
        )
    return "\n".join(lines)


def tool_cells(path: str) -> dict[tuple[int, str], list[dict]]:
    """The tool task's rows by (`max_staleness`, `off_policy_correction`, "-" for none named), synchronous first."""
    cells = defaultdict(list)
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                row = json.loads(line)
                cells[(row["max_staleness"], row["off_policy_correction"] or "-")].append(row)
    return dict(sorted(cells.items()))


def tool_table(cells: dict[tuple[int, str], list[dict]]) -> str:
    """The tool task's table: one line per (`max_staleness`, `off_policy_correction`)."""

    def eps(row: dict) -> float:
        return row["updates"] * row["batch_size"] / row["train_wall_seconds"]

    def spread(values: list[float]) -> str:
        return f"{statistics.mean(values):.2f} [{min(values):.2f}, {max(values):.2f}]"

    sync = statistics.median(eps(row) for row in cells.get((0, "-"), [])) if (0, "-") in cells else float("nan")
    lines = ["| max_staleness | correction | seeds | episodes/s (median) | x sync | training CPU s (median) "
             "| training success, last 4 updates | held-out before | held-out after | critic EV, last 4 updates |",
             "|---" * 10 + "|"]
    for (staleness, correction), rows in cells.items():
        median = statistics.median(eps(row) for row in rows)
        cpu = statistics.median(row["train_cpu_seconds"] for row in rows)
        late = [statistics.mean(row["training_success"][-4:]) for row in rows]
        before, after = ([row[key]["success"] for row in rows] for key in ("before", "after"))
        lines.append(f"| {staleness} | {correction} | {len(rows)} | {median:.3f} | {median / sync:.2f} | {cpu:.0f} "
                     f"| {spread(late)} | {spread(before)} | {spread(after)} | {late_explained_variance(rows)} |")
    return "\n".join(lines)


def late_explained_variance(rows: list[dict]) -> str:
    """The critic's `val/explained_variance` (all tokens) over the last 4 updates, mean over them, then mean, min and
    max over the rows that recorded it (rows before e99615d did not: "-")."""
    late = []
    for row in rows:
        curve = [v for v in row.get("explained_variance", {}).get("all", [])[-4:] if v is not None]
        if curve:
            late.append(statistics.mean(curve))
    if not late:
        return "-"
    return f"{statistics.mean(late):.3f} [{min(late):.3f}, {max(late):.3f}] ({len(late)} seeds)"


# The tool task's curves: the colour says the correction, the line the staleness.
CORRECTION_COLOURS = {"-": "tab:blue", "tis": "tab:orange", "decoupled": "tab:green", "none": "tab:red"}
STALENESS_STYLES = {0: "-", 1: "--", 2: ":"}


def tool_plot(cells: dict[tuple[int, str], list[dict]], path: str) -> None:
    """Each cell's training success per update, the mean over its seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.2))
    for (staleness, correction), rows in cells.items():
        mean = [statistics.mean(points) for points in zip(*(row["training_success"] for row in rows))]
        label = "synchronous" if staleness == 0 else f"max_staleness={staleness}, {correction}"
        axis.plot(range(1, len(mean) + 1), mean, marker="o", markersize=3, label=f"{label} ({len(rows)} seeds)",
                  color=CORRECTION_COLOURS.get(correction), linestyle=STALENESS_STYLES.get(staleness, "-."))
    finish(figure, axis, ("update (8 episodes each)", "training success (mean over seeds)",
                          "SmolLM2-135M tool task: synchronous and asynchronous PPO"), path)


def finish(figure, axis, labels: tuple[str, str, str], path: str) -> None:
    """Label the axes and title (`labels`), add the grid and legend, and save the figure to `path`."""
    xlabel, ylabel, title = labels
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def plot(groups: dict[tuple, list[dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.2))
    for (judge, cell), rows in groups.items():
        if judge != "none":
            continue
        curves = [row["score_curve"] for row in rows]
        mean = [statistics.mean(points) for points in zip(*curves)]
        steps = [LOG_EVERY * (i + 1) for i in range(len(mean))]
        axis.plot(steps, mean, marker="o", markersize=3, label=f"{cell} ({len(rows)} seeds)")
    finish(figure, axis, ("update", "objective/scores (mean over seeds)",
                          "The default job: synchronous and asynchronous PPO"), path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rows")
    parser.add_argument("--plot", help="PNG of the score curves (with --tool: of the training success)")
    parser.add_argument("--tool", action="store_true", help="the rows are the SmolLM2 tool task's")
    args = parser.parse_args(argv)
    if args.tool:
        cells = tool_cells(args.rows)
        print(tool_table(cells))
        if args.plot:
            tool_plot(cells, args.plot)
        return
    groups = load(args.rows)
    print(table(groups))
    if args.plot:
        plot(groups, args.plot)


if __name__ == "__main__":
    main()

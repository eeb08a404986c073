"""The table of the rows `run.py` wrote: per task and method, the start's and the final success (greedy and
sampled on held-out starts; mean ± sd over seeds), episodes to reach 0.8 per seed, and CPU seconds.

    python benchmark/credit/report.py benchmark/credit/calibration.jsonl
    python benchmark/credit/report.py rows.jsonl --best_lr "gae --gae_level turn"   # prints the rate table.sh uses

The best learning rate of a method is chosen on seed 0 over all tasks: the rate that learnt and kept the most tasks
(reached 0.8 in training and ended at a sampled success of at least 0.8), then the fewest episodes to reach 0.8
summed over tasks (a run that never did counts its whole budget). (A first rule counted tasks that reached 0.8 only:
at 3e-3 it chose rates under which a run reached 0.8 and then collapsed to 0 for good; changed before seeds 1-4
of any method it affected had run.)
Given the rows of a sweep (several rates on seed 0), the report prints the sweep's table, then the table, the
summary per method and (`--plot PNG`) the learning curves of the chosen rates only.

    python benchmark/credit/report.py rows.jsonl --plot curves.png
    python benchmark/credit/report.py rows.jsonl --versus "gae (turn) random critic, ..." --ev_plot ev.png

With a critic, the table also gives, per seed, the first update at which the first-turn explained variance
(`val/explained_variance/turn_1`, averaged over the last 10 updates) reached 0.5.
`--versus METHOD` counts, per task, the seeds on which METHOD was ahead of each other method: a higher mean training
success over the run (the area under its success curve: how fast and how far it learnt), seed against same seed.
`--ev_plot PNG` draws the critics' first-turn explained variance per task.
"""

from __future__ import annotations

import argparse
import json
import statistics
import textwrap


def method(row: dict) -> str:
    """The method's name in the table, with its extra config fields (run.py --config) where it has any."""
    name = f"gae ({row['gae_level']})" if row["estimator"] == "gae" else row["estimator"]
    fields = {"value_init": "random"} if row.get("value_init") == "random" else {}
    extra = ", ".join(f"{k}={v}" for k, v in (fields | (row.get("config") or {})).items())
    return f"{name} {extra}" if extra else name


def mean_sd(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def table(rows: list[dict]) -> str:
    lines = ["| task | method | seeds | lr | start greedy / sampled | final greedy | final sampled | episodes to 0.8 "
             "| first-turn EV >= 0.5 at update | CPU s |", "|---" * 10 + "|"]
    cells: dict[tuple, list[dict]] = {}
    for row in rows:
        cells.setdefault((row["task"], method(row), row["lr"]), []).append(row)
    for (task, name, lr), mine in sorted(cells.items()):
        def both(when: str, mine=mine) -> tuple[str, str]:
            return tuple(mean_sd([r[when][protocol] for r in mine]) for protocol in ("greedy", "sampled"))

        reach = ", ".join(str(r["episodes_to_0.8"] or "never") for r in mine)
        explained = ", ".join(str(ev_reached(r) or "never") for r in mine) if "ev_turn_1" in mine[0] else "-"
        cpu = statistics.mean(r["cpu_seconds"] for r in mine)
        lines.append(f"| {task} | {name} | {len(mine)} | {lr:g} | {' / '.join(both('before'))} | "
                     f"{' | '.join(both('final'))} | {reach} | {explained} | {cpu:.0f} |")
    return "\n".join(lines)


def ev_reached(row: dict, level: float = 0.5, window: int = 10) -> int | None:
    """The first update (1-based) at which the first-turn explained variance, averaged over the last `window`
    updates (one update's is noisy), reached `level` (None: never)."""
    curve = row["ev_turn_1"]
    for i in range(window - 1, len(curve)):
        last = [ev for ev in curve[i - window + 1:i + 1] if ev is not None]
        if last and statistics.mean(last) >= level:
            return i + 1
    return None


def versus(rows: list[dict], name: str) -> str:
    """Per task and other method: the seeds (run by both) on which `name` had the higher mean training success."""
    lines = [f"| task | {name} ahead of | seeds ahead | its mean success over the run | theirs |", "|---" * 5 + "|"]
    area = {(r["task"], method(r), r["seed"]): statistics.mean(r["success_curve"]) for r in rows}
    for task in sorted({r["task"] for r in rows}):
        for other in sorted({method(r) for r in rows if r["task"] == task} - {name}):
            seeds = sorted(s for t, m, s in area if t == task and m == other and (task, name, s) in area)
            if not seeds:
                continue
            ahead = sum(area[task, name, s] > area[task, other, s] for s in seeds)
            mine = statistics.mean(area[task, name, s] for s in seeds)
            theirs = statistics.mean(area[task, other, s] for s in seeds)
            lines.append(f"| {task} | {other} | {ahead} of {len(seeds)} | {mine:.3f} | {theirs:.3f} |")
    return "\n".join(lines)


def flags_to_method(flags: str) -> str:
    """sweep.sh's spelling of a method ("gae --gae_level turn", "rloo") -> its name in the table."""
    words = flags.split()
    return f"gae ({words[words.index('--gae_level') + 1]})" if words[0] == "gae" else words[0]


def seed0_by_lr(rows: list[dict], name: str) -> dict[float, list[dict]]:
    by_lr: dict[float, list[dict]] = {}
    for row in rows:
        if method(row) == name and row["seed"] == 0:
            by_lr.setdefault(row["lr"], []).append(row)
    return by_lr


def rank(runs: list[dict]) -> tuple[int, int]:
    """(minus the tasks learnt and kept: reached 0.8 in training and ended at a sampled success of at least 0.8;
    the episodes to reach 0.8 summed over tasks, a run that never did counting its whole budget): smaller is
    better."""
    kept = sum(r["episodes_to_0.8"] is not None and r["final"]["sampled"] >= 0.8 for r in runs)
    reached = [r["episodes_to_0.8"] for r in runs]
    budget = [r["updates"] * r["episodes_per_update"] for r in runs]
    return (-kept, sum(e if e is not None else b for e, b in zip(reached, budget)))


def best_lr(rows: list[dict], name: str) -> float:
    """The learning rate of method `name` whose seed-0 runs rank best (`rank`)."""
    by_lr = seed0_by_lr(rows, name)
    if not by_lr:
        raise SystemExit(f"no seed-0 rows of {name!r}: run the learning-rate sweep first")
    return min(sorted(by_lr), key=lambda lr: rank(by_lr[lr]))


def sweep_table(rows: list[dict]) -> str:
    """Seed 0, every method x learning rate: what `best_lr` ranks by, and the final sampled success."""
    lines = ["| method | lr | tasks learnt and kept | episodes to 0.8, summed over tasks "
             "| final sampled, mean over tasks |",
             "|---" * 5 + "|"]
    for name in sorted({method(r) for r in rows}):
        by_lr, chosen = seed0_by_lr(rows, name), best_lr(rows, name)
        for lr, runs in sorted(by_lr.items()):
            kept, episodes = rank(runs)
            final = statistics.mean(r["final"]["sampled"] for r in runs)
            mark = " (chosen)" if lr == chosen else ""
            lines.append(f"| {name} | {lr:g}{mark} | {-kept} of {len(runs)} | {episodes} | {final:.2f} |")
    return "\n".join(lines)


def chosen(rows: list[dict]) -> list[dict]:
    """The rows at each method's chosen learning rate (the table's)."""
    rates = {name: best_lr(rows, name) for name in {method(r) for r in rows}}
    return [r for r in rows if r["lr"] == rates[method(r)]]


def summary(rows: list[dict]) -> str:
    """Per method over all tasks and seeds: final sampled success, runs that never reached 0.8 and runs that ended
    below it (reached it, then lost it), median episodes to 0.8."""
    lines = ["| method | runs | final sampled (mean ± sd) | never reached 0.8 | ended below 0.8 "
             "| median episodes to 0.8 |",
             "|---" * 6 + "|"]
    for name in sorted({method(r) for r in rows}):
        mine = [r for r in rows if method(r) == name]
        reached = [r["episodes_to_0.8"] for r in mine if r["episodes_to_0.8"] is not None]
        median = f"{statistics.median(reached):.0f}" if reached else "-"
        below = sum(r["final"]["sampled"] < 0.8 for r in mine)
        lines.append(f"| {name} | {len(mine)} | {mean_sd([r['final']['sampled'] for r in mine])} | "
                     f"{len(mine) - len(reached)} | {below} | {median} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, smooth: int = 10, field: str = "success_curve",
         ylabel: str = "training success", low: float | None = None) -> None:
    """One panel per task: each method's training success (or another per-update `field` of the rows: mean over
    seeds, moving mean of `smooth` updates; updates where it is undefined are left out of the mean, values below
    `low` drawn at `low`: an explained variance over returns that barely vary can be -10^4)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, task_names = sorted({method(r) for r in rows}), sorted({r["task"] for r in rows})
    columns = 3
    rows_ = -(-(len(task_names) + 1) // columns)  # a panel per task and one for the legend
    figure, axes = plt.subplots(rows_, columns, figsize=(4.2 * columns, 3.2 * rows_), sharey=True,
                                 squeeze=False)
    legend = {}  # a method -> its line and label, from the first panel it is drawn in (some run on some tasks only)
    for axis, task in zip(axes.flat, task_names):
        for name in names:
            curves = [r[field] for r in rows if r["task"] == task and method(r) == name and field in r]
            if not curves:
                continue
            steps = min(map(len, curves))
            floor = (lambda v: v) if low is None else (lambda v: max(v, low))  # noqa: E731
            mean = [statistics.mean([floor(c[i]) for c in curves if c[i] is not None] or [0.0]) for i in range(steps)]
            moving = [statistics.mean(mean[max(0, i - smooth + 1):i + 1]) for i in range(steps)]
            per_update = next(r["episodes_per_update"] for r in rows if r["task"] == task and method(r) == name)
            label = textwrap.fill(f"{name} ({len(curves)} seeds)", 48)
            line, = axis.plot([(i + 1) * per_update for i in range(steps)], moving, label=label,
                              color=f"C{names.index(name) % 10}")  # a method's colour in every panel
            legend.setdefault(name, (line, label))
        axis.set_title(task)
        axis.set_xlabel("episodes")
        axis.axhline(0.8 if field == "success_curve" else 0.5, color="grey", linewidth=0.5)
    for axis in axes[:, 0]:
        axis.set_ylabel(ylabel)
    for axis in list(axes.flat)[len(task_names):]:
        axis.axis("off")
    handles, labels = zip(*(legend[name] for name in names if name in legend))
    axes.flat[-1].legend(handles, labels, loc="center", title="method (seeds per task)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rows", help="JSONL file of run.py rows")
    parser.add_argument("--best_lr", metavar="METHOD", help="print the best seed-0 learning rate of METHOD only")
    parser.add_argument("--plot", metavar="PNG", help="also draw the learning curves at the chosen rates")
    parser.add_argument("--versus", metavar="METHOD", help="also count the seeds METHOD was ahead of each other")
    parser.add_argument("--ev_plot", metavar="PNG", help="also draw the critics' first-turn explained variance")
    args = parser.parse_args(argv)
    with open(args.rows) as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    if args.best_lr:
        print(f"{best_lr(rows, flags_to_method(args.best_lr)):g}")
        return
    if len({r["lr"] for r in rows if r["seed"] == 0}) > 1:  # a learning-rate sweep: its table, then the chosen rates'
        print(sweep_table(rows) + "\n")
        rows = chosen(rows)
    print(table(rows) + "\n\n" + summary(rows))
    if args.versus:
        print("\n" + versus(rows, args.versus))
    if args.plot:
        plot(rows, args.plot)
    if args.ev_plot:
        plot(rows, args.ev_plot, field="ev_turn_1", ylabel="first-turn explained variance", low=-1.0)


if __name__ == "__main__":
    main()

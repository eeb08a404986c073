"""The table and plot of `slow_tools.py`'s rows: per tool delay and config, episodes per wall-second and per
CPU-second, each against TRL GRPO's at the same delay, and peak RSS.

    cd benchmark/agents && python slow_tools_report.py slow_tools.jsonl --plot slow_tools.png
"""

from __future__ import annotations

import argparse
import json

ORDER = ("ppo", "ppo-lockstep", "grpo", "grpo-sampler", "trl_grpo")


def table(rows: list[dict]) -> str:
    """A markdown table, one line per (delay, config); the last row of a cell wins (a rerun replaces it)."""
    cells = {(row["delay"], row["config"]): row for row in rows}
    lines = ["| tool delay | config | episodes / wall-s | × TRL GRPO | episodes / CPU-s | × TRL GRPO | peak RSS GB |",
             "|---|---|---|---|---|---|---|"]
    for delay in sorted({delay for delay, _ in cells}):
        trl = cells.get((delay, "trl_grpo"))
        for config in ORDER:
            row = cells.get((delay, config))
            if row is None:
                continue
            ratios = [f"{row[k] / trl[k]:.2f}" if trl else "-" for k in ("episodes_per_wall_s", "episodes_per_cpu_s")]
            lines.append(f"| {delay:g} s | `{config}` | {row['episodes_per_wall_s']:.3f} | {ratios[0]} | "
                         f"{row['episodes_per_cpu_s']:.3f} | {ratios[1]} | {row['peak_rss_gb']:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = {(row["delay"], row["config"]): row for row in rows}
    delays = sorted({delay for delay, _ in cells})
    configs = [config for config in ORDER if any(config == name for _, name in cells)]  # bars of what ran
    figure, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    width = 0.8 / len(configs)
    for panel, (key, title) in zip(axes, (("episodes_per_wall_s", "episodes per wall-second"),
                                          ("episodes_per_cpu_s", "episodes per CPU-second"))):
        for i, config in enumerate(configs):
            values = [cells[(d, config)][key] if (d, config) in cells else 0.0 for d in delays]
            panel.bar([j + i * width for j in range(len(delays))], values, width, label=config)
        panel.set_xticks([j + 0.4 - width / 2 for j in range(len(delays))], [f"{d:g} s per call" for d in delays])
        panel.set_title(title)
    axes[0].legend(fontsize=8)
    figure.suptitle("SmolLM2-135M tool task, 2 updates x 8 episodes (CPU, one thread)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rows")
    parser.add_argument("--plot", default=None)
    args = parser.parse_args(argv)
    with open(args.rows, encoding="utf-8") as file:
        rows = [json.loads(line) for line in file if line.strip()]
    print(table(rows))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()

"""Bar charts of episodes/s and peak memory per shape and precision for trl_ppo and TRL, from the JSON lines that
`bench_ppo.py` appends (speed runs only; the median run of each trainer and config).

    python benchmark/speed/plot_results.py benchmark/speed/results_h100.jsonl benchmark/speed/results_cpu.jsonl \
        -o benchmark/speed/results.png
"""

import argparse
import json
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SHAPE_ORDER = ["tiny", "tiny-50k", "160m", "410m", "1b"]
COLORS = {"trl_ppo": "tab:blue", "trl": "tab:gray"}
LABELS = {"trl_ppo": "trl_ppo", "trl": "TRL 1.12"}


def median_rows(paths: list[str]) -> dict:
    """{(device, shape, precision): {trainer: median row by episodes/s}}"""
    runs = defaultdict(list)
    for path in paths:
        with open(path) as lines:
            for line in lines:
                row = json.loads(line)
                # single-process speed rows only: not parity runs, sharded layouts (`layout`) or other checks
                if "trainer" in row and not row.get("parity") and not row.get("layout"):
                    runs[(row["device"], row["shape"], row["precision"], row["trainer"])].append(row)
    table = defaultdict(dict)
    for (device, shape, precision, trainer), rows in runs.items():
        rows.sort(key=lambda r: r["episodes_per_second"])
        table[(device, shape, precision)][trainer] = rows[len(rows) // 2]
    return table


def short_device(name: str) -> str:
    """ "NVIDIA H100 80GB HBM3" -> "H100", "cpu" -> "CPU", "cpu: AMD EPYC, 2 cores" -> "EPYC CPU"."""
    if name.startswith("cpu"):
        model = name[4:].split(",")[0].split()
        return f"{model[-1]} CPU" if model else "CPU"
    return name.replace("NVIDIA ", "").split()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+")
    parser.add_argument("-o", "--output", default="benchmark/speed/results.png")
    cli = parser.parse_args()
    table = median_rows(cli.results)
    configs = sorted(table, key=lambda k: (k[0].startswith("cpu"), k[0], SHAPE_ORDER.index(k[1]), k[2]))
    labels = [f"{shape}\n{precision}\n{short_device(device)}" for device, shape, precision in configs]
    figure, axes = plt.subplots(1, 2, figsize=(16, 6))
    width = 0.38
    for panel, (key, title, unit) in enumerate(
        [
            ("episodes_per_second", "Episodes per second (higher is better)", "episodes/s"),
            ("peak_memory_gib", "Peak memory (lower is better)", "GiB"),
        ]
    ):
        axis = axes[panel]
        for offset, trainer in ((-width / 2, "trl_ppo"), (width / 2, "trl")):
            values = [table[c].get(trainer, {}).get(key, 0.0) for c in configs]
            bars = axis.bar(
                [i + offset for i in range(len(configs))], values, width, color=COLORS[trainer], label=LABELS[trainer]
            )
            axis.bar_label(bars, fmt="%.1f", fontsize=7)
        axis.set_xticks(range(len(configs)), labels, fontsize=8)
        axis.set_title(title)
        axis.set_ylabel(unit)
        axis.set_yscale("log")
        axis.legend()
    figure.suptitle("trl_ppo vs TRL 1.12 PPO, same config (batch 64, 4 PPO epochs, 53 response tokens)")
    figure.tight_layout()
    figure.savefig(cli.output, dpi=110)
    print(cli.output)


if __name__ == "__main__":
    main()

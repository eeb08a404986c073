"""The table and plot of `smollm2_tool.py`'s rows: per method and learning rate, greedy held-out success of the
warm start and after training (each seed), the gain, tool calls and tool errors per episode, training CPU seconds.

    python benchmark/agents/smollm2_tool_report.py benchmark/agents/smollm2_tool.jsonl --plot smollm2_tool.png
"""

from __future__ import annotations

import argparse
import json
import statistics


def cells(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Rows grouped by (estimator, with the critic's own rate and the lockstep loop where set; learning rate,
    updates, batch size, missing-EOS penalty, max gradient norm, KL coefficient, zero-gradient steps skipped), seeds
    in order: rows of other settings are never pooled."""
    groups: dict[tuple, list[dict]] = {}
    for row in sorted(rows, key=lambda r: r["seed"]):
        critic_lr = row.get("critic_learning_rate")
        method = row["estimator"] + (f" (critic lr {critic_lr:g})" if critic_lr is not None else "")
        method += " (lockstep)" if row.get("agent_rollout") == "lockstep" else ""
        key = (method, row["learning_rate"], row["updates"], row["batch_size"],
               row.get("missing_eos_penalty"), row.get("max_grad_norm"), row.get("kl_coef"),
               bool(row.get("skip_zero_gradient_steps")))
        groups.setdefault(key, []).append(row)
    return groups


def mean(values) -> float:
    return statistics.mean(values) if values else float("nan")


def table(rows: list[dict]) -> str:
    lines = ["| method | lr | updates x episodes | EOS penalty | gradient clipped to | KL coef. | seeds | "
             "held-out success: warm start -> after (each seed) | mean gain | calls / episode after | "
             "tool errors / episode after | training CPU-s (mean) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (estimator, lr, updates, batch, penalty, clip, kl, skip), group in sorted(cells(rows).items(), key=str):
        gains = [r["after"]["success"] - r["before"]["success"] for r in group]
        method = estimator + (", zero-gradient steps skipped" if skip else "")
        seeds = ", ".join(f"{r['before']['success']:.2f} -> {r['after']['success']:.2f}" for r in group)
        lines.append(
            f"| {method} | {lr:g} | {updates} x {batch} | {penalty or 'none'} | {clip or 'none'} | {kl:g} | "
            f"{len(group)} | {seeds} | "
            f"{mean(gains):+.2f} | "
            f"{mean([r['after']['calls_per_episode'] for r in group]):.2f} | "
            f"{mean([r['after']['tool_errors_per_episode'] for r in group]):.2f} | "
            f"{training_cpu(group)} |")
    return "\n".join(lines)


def training_cpu(group: list[dict]) -> str:
    """The mean training CPU seconds of the runs that ran whole in one process; a resumed run counts its last
    process only, so it is left out (and counted)."""
    whole = [r["train_cpu_seconds"] for r in group if not r.get("resumed")]
    resumed = len(group) - len(whole)
    return (f"{mean(whole):.0f}" if whole else "-") + (f" ({resumed} resumed, left out)" if resumed else "")


def settings_label(penalty, clip, estimator: str, kl: float, skip: bool = False) -> str:
    """What sets a cell apart from the plain runs, in the plot's labels (TRL's GRPO has no KL term by default)."""
    plain_kl = 0.0 if estimator == "trl_grpo" else 0.05
    return (" EOS pen." if penalty else "") + (f" clip {clip:g}" if clip else "") + (
        f" KL {kl:g}" if kl != plain_kl else "") + (" skip 0-grad" if skip else "")


def plot(rows: list[dict], path: str) -> None:
    """Left: each method's training success per update (mean over seeds). Right: held-out success before and
    after, each seed a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (curves, held_out) = plt.subplots(1, 2, figsize=(13, 4.2))
    groups = sorted(cells(rows).items(), key=str)
    for index, ((estimator, lr, updates, batch, penalty, clip, kl, skip), group) in enumerate(groups):
        name = f"{estimator} lr {lr:g}{settings_label(penalty, clip, estimator, kl, skip)} ({len(group)})"
        steps = min(len(r["training_success"]) for r in group)
        curve = [mean([r["training_success"][i] for r in group]) for i in range(steps)]
        curves.plot([(i + 1) * batch for i in range(steps)], curve, label=name)
        for row in group:
            held_out.plot([index - 0.15, index + 0.15], [row["before"]["success"], row["after"]["success"]],
                          marker="o", color=f"C{index}", alpha=0.7)
    curves.set_xlabel("training episodes")
    curves.set_ylabel("training success (sampled)")
    curves.legend(fontsize=8)
    settings = [settings_label(*key[4:6], key[0], *key[6:]).strip().replace(" skip", "\nskip") for key, _ in groups]
    labels = ["\n".join(filter(None, (key[0], f"{key[1]:g}", extra))) for (key, _), extra in zip(groups, settings)]
    held_out.set_xticks(range(len(groups)), labels, fontsize=8)
    held_out.set_ylabel("held-out success (greedy)\nwarm start -> after")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rows", help="JSONL file of smollm2_tool.py rows")
    parser.add_argument("--plot", metavar="PNG", help="also draw the training curves and held-out success")
    args = parser.parse_args(argv)
    with open(args.rows) as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    print(table(rows))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()

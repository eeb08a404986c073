"""The stale-run remedies table (RESULTS, "Stale-run remedies"): one line per row of `stale_remedies.jsonl` (the
SmolLM2 tool task at `max_staleness=1`), beside the synchronous rows of `smollm2_tool.jsonl`.

    python benchmark/asynchronous/stale_report.py
"""

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def rows(name: str) -> list[dict]:
    with open(os.path.join(HERE, name), encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def cell(row: dict) -> str:
    if not row.get("max_staleness"):
        return "synchronous"
    clip = f", clip {row['max_grad_norm']:g}" if row.get("max_grad_norm") else ""
    minibatches = f", {row['num_mini_batches']} minibatches" if row.get("num_mini_batches") else ""
    critic = f" (critic {row['critic_learning_rate']:g})" if row.get("critic_learning_rate") else ""
    rate = f", lr {row['learning_rate']:g}{critic}" if row["learning_rate"] != 3e-5 or critic else ""
    kl = f", kl_coef {row['kl_coef']:g}" if row.get("kl_coef", 0.05) != 0.05 else ""
    estimator = f"{row['estimator']}, " if row["estimator"] != "gae" else ""
    return f"stale 1, {estimator}{row['off_policy_correction']}{clip}{minibatches}{rate}{kl}"


def line(row: dict) -> str:
    mean, top, cut = (row.get(name) for name in ("is_weight_mean", "is_weight_max", "is_truncated_frac"))
    weights = "" if mean is None else f"{min(mean):.3f}-{max(mean):.3f} | {max(top):.2f} | {100 * max(cut):.2f}"
    curve = row["training_success"]
    return (f"| {cell(row)} | {row['seed']} | {row['after']['success']:.2f} | {sum(curve[-4:]) / 4:.2f} | "
            f"{weights or '- | - | -'} | {row['train_cpu_seconds']:.0f} | {row['train_wall_seconds']:.0f} |")


def main() -> None:
    print("| cell | seed | held-out after | training success, last 4 | is_weight_mean (range) | is_weight_max | "
          "% tokens above C (max) | training CPU s | training wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    synchronous = [r for r in rows("smollm2_tool.jsonl") if not r.get("max_staleness") and r["updates"] == 16]
    for row in sorted(synchronous, key=lambda r: r["seed"]) + rows("stale_remedies.jsonl"):
        print(line(row))


if __name__ == "__main__":
    main()

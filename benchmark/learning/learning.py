"""What PPO options are worth, on a laptop CPU: a learning benchmark with a verifiable reward, trl_ppo's options
against its defaults and against TRL 1.12's PPO trainer.

    python benchmark/learning/learning.py --smoke              # CI form: tiny SFT, 2 updates, 1 seed (~30 s)
    python benchmark/learning/learning.py --plot benchmark/learning/learning.png   # every config and TRL, seeds 0 1 2
    python benchmark/learning/learning.py --configs trl_ppo trl --seeds 0 1 2 3 4

The task (`learning_task.py`): two-digit addition, "23+45=" -> "68", one token per character. A tiny GPT-NeoX
(64 wide, 2 layers) is trained from scratch by supervised fine-tuning (SFT, ~10 s, cached in `--output_dir`
under a name made of its settings) on imperfect demonstrations: 60% of those with a carry forget it
(27+45 -> "62"). The SFT policy answers ~45% of 500 held-out problems greedily (most carry problems wrong);
PPO then starts from it on 2,000 training problems with reward 1.0 for a correct answer and 0.0 otherwise (a
trl_ppo reward function; TRL 1.12 only takes a reward *model*, so for it the same rule as an `nn.Module`,
`RuleRewardModel`), minus the missing-EOS penalty (1.0, `stop_token="eos"`).

Every run (one config, one seed) is its own subprocess. All runs share the SFT policy, the value model (the SFT
backbone with a score head drawn from the seed), the reference (a copy of the policy) and the hyper-parameters
in `PPO`, both trainers in fp32 without gradient checkpointing (TRL 1.12's defaults would turn both on). A
config's flags (`CONFIGS`) are added to trl_ppo's `PPOConfig`; `trl` is TRL 1.12's trainer.

Measured: greedy accuracy on the held-out problems before PPO (the SFT policy), after it and every
`--eval_every` updates; the fraction of correct answers among each update's sampled responses (counted by the
reward itself, before the EOS penalty); seconds per run (trainer set-up and training, evaluations left out)
and per update. Printed as a Markdown table (mean ± std over seeds), appended as JSON lines to `--results`;
`--plot` draws the mean curves.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # learning_task.py here, rows.py in benchmark/
import learning_task as task  # noqa: E402
from rows import append_row, print_row  # noqa: E402

# trl_ppo configs: name -> PPOConfig flags on top of `PPO`. "trl" (TRL 1.12's trainer) is run besides these.
CONFIGS: dict[str, dict] = {
    "trl_ppo": {},
    "seq-mean-token-mean": {"loss_agg_mode": "seq-mean-token-mean"},
    "seq-mean-token-sum": {"loss_agg_mode": "seq-mean-token-sum"},
    "seq-mean-token-sum-norm": {"loss_agg_mode": "seq-mean-token-sum-norm"},
    "clip-higher": {"cliprange_low": 0.2, "cliprange_high": 0.28},
    "dual-clip": {"dual_clip": 3.0},
    "entropy": {"entropy_coef": 0.01},
    "critic-warmup": {"critic_warmup_steps": 3},
    "lam-value": {"lam_value": 1.0},
    # VAPO's alpha (0.05) is for responses of hundreds of tokens: on these 3-4 token answers it gives lambda < 0,
    # clamped to 0. alpha 5 gives lambda 0.95 at 4 tokens, the default lam's.
    "length-adaptive-lam": {"length_adaptive_lam_alpha": 5.0, "lam": 1.0},
    "length-adaptive-lam-vapo": {"length_adaptive_lam_alpha": 0.05, "lam": 1.0},
    "kl-loss": {"kl_loss_coef": 0.001, "kl_coef": 0.0},
    "kl-k2": {"kl_estimator": "k2"},
}
TRL = "trl"
PPO = dict(  # shared by every run; total_episodes = `updates` x batch (32 x 4 = 128)
    updates=30,
    per_device_train_batch_size=32,
    gradient_accumulation_steps=4,
    num_mini_batches=1,
    num_ppo_epochs=4,
    learning_rate=1e-4,
    kl_coef=0.05,
    temperature=0.7,
    response_length=5,  # answers have at most 3 digits, then EOS
)
SFT = task.SFTSettings(hidden_size=64, num_layers=2, steps=900, carry_slip=0.6)  # ~10 s; greedy accuracy ~0.44
SMOKE_SFT = task.SFTSettings(hidden_size=32, num_layers=1, steps=60, carry_slip=0.6)
SMOKE_PPO = dict(PPO, updates=2, per_device_train_batch_size=8, gradient_accumulation_steps=2)
# Every benchmark run: fp32 on the CPU, no gradient checkpointing (TRL 1.12's defaults would turn both on), no
# saving or reporting, a log per update.
CPU_RUN = dict(save_strategy="no", report_to="none", logging_steps=1, bf16=False, gradient_checkpointing=False,
               use_cpu=True, disable_tqdm=True)
NUM_PROMPTS = 2000  # PPO prompts, drawn from the pool SFT trained on, never from the eval problems


# ----------------------------------------------------------------------------------------------- one run
def curve_callback(recorder, policy, tokenizer, eval_problems, eval_every: int, response_length: int):
    """A TrainerCallback that closes each update's sampled accuracy, keeps the logged scores, times the updates
    and evaluates the policy greedily every `eval_every` updates (that time left out)."""
    from transformers import TrainerCallback

    class Curve(TrainerCallback):
        def __init__(self) -> None:
            self.sampled, self.scores, self.evals = [], [], []
            self.start, self.end, self.eval_seconds = 0.0, 0.0, 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.sampled.append(recorder.flush())
            if eval_every and state.global_step % eval_every == 0:
                start = time.perf_counter()
                accuracy = task.greedy_accuracy(policy, tokenizer, eval_problems, response_length)
                self.evals.append([state.global_step, accuracy])
                self.eval_seconds += time.perf_counter() - start
            self.end = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "objective/scores" in logs:
                self.scores.append(round(float(logs["objective/scores"]), 5))

        def seconds_per_update(self) -> float:
            return (self.end - self.start - self.eval_seconds) / max(len(self.sampled), 1)

    return Curve()


def ppo_config(name: str, spec: dict):
    """The run's PPOConfig, TRL's for "trl", else trl_ppo's with the config's flags."""
    ppo = spec["ppo"]
    batch = ppo["per_device_train_batch_size"] * ppo["gradient_accumulation_steps"]
    common = {k: v for k, v in ppo.items() if k != "updates"}
    common.update(
        output_dir=os.path.join(spec["output_dir"], "runs", f"{name}-{spec['seed']}"),
        total_episodes=batch * ppo["updates"],
        local_rollout_forward_batch_size=batch,
        missing_eos_penalty=1.0,
        stop_token="eos",
        seed=spec["seed"],
        num_sample_generations=0,
        **CPU_RUN,
    )
    if name == TRL:
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        from trl.experimental.ppo import PPOConfig

        return PPOConfig(**common)
    from trl_ppo import PPOConfig

    return PPOConfig(**{**common, **CONFIGS[name]})


def run_one(spec: dict) -> dict:
    """Train one config on one seed in this process; -> its result row."""
    import torch
    from datasets import Dataset

    torch.set_num_threads(spec["threads"])
    name, seed, ppo = spec["config"], spec["seed"], spec["ppo"]
    tokenizer = task.build_char_tokenizer()
    eval_problems, pool = task.split_problems()
    prompts = [task.prompt_text(a, b) for a, b in pool[: spec["prompts"]]]
    dataset = Dataset.from_dict({"input_ids": [tokenizer(p)["input_ids"] for p in prompts]})
    policy, value_model = task.load_models(spec["sft_path"], value_seed=seed)
    before = task.greedy_accuracy(policy, tokenizer, eval_problems, ppo["response_length"])
    recorder = task.Recorder()
    curve = curve_callback(recorder, policy, tokenizer, eval_problems, spec["eval_every"], ppo["response_length"])
    config = ppo_config(name, spec)
    if name == TRL:
        from trl.experimental.ppo import PPOTrainer

        reward = task.RuleRewardModel(tokenizer, recorder)
    else:
        from trl_ppo import PPOTrainer

        reward = task.recording_reward(recorder)
    start = time.perf_counter()
    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=None,
        reward_model=reward,
        value_model=value_model,
        train_dataset=dataset,
        callbacks=[curve],
    )
    trainer.train()
    seconds = time.perf_counter() - start - curve.eval_seconds
    after = task.greedy_accuracy(policy, tokenizer, eval_problems, ppo["response_length"])
    return {
        "config": name,
        "trainer": TRL if name == TRL else "trl_ppo",
        "flags": {} if name == TRL else CONFIGS[name],
        "seed": seed,
        "accuracy_before": before,
        "accuracy_after": after,
        "sampled_accuracy": curve.sampled,
        "eval_accuracy": curve.evals,
        "scores": curve.scores,
        "seconds": round(seconds, 2),
        "seconds_per_update": round(curve.seconds_per_update(), 4),
        "threads": spec["threads"],
        "ppo": ppo,
        "sft": spec["sft"],
        "smoke": spec["smoke"],
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }


def serve_worker(spec: str | None, run_one) -> bool:
    """In a `run_worker` subprocess (`--worker SPEC` given): run `run_one(SPEC)` and print its row -> True;
    otherwise False."""
    if spec is None:
        return False
    print_row(run_one(json.loads(spec)))
    return True


def run_worker(spec: dict, script: str = __file__) -> dict | None:
    """`script --worker SPEC` (its `run_one`) in a fresh subprocess; -> its row, or None (its output shown) when
    it failed."""
    command = [sys.executable, os.path.abspath(script), "--worker", json.dumps(spec)]
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    rows = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not rows:
        print(f"[{spec['config']} seed {spec['seed']}] failed (exit {done.returncode}):", file=sys.stderr)
        print((done.stdout + done.stderr)[-4000:], file=sys.stderr)
        return None
    return json.loads(rows[-1])


def run_seeds(spec: dict, seeds, names, configs: dict, results: str, script: str, describe) -> list[dict]:
    """Each config of `names` on each seed, each run in a fresh process (`run_worker`, `configs[name]` over the
    spec's `rl`); each row appended to `results` as a JSON line and `describe(row)` logged -> the rows."""
    rows = []
    for seed in seeds:
        for name in names:
            row = run_worker(dict(spec, rl={**spec["rl"], **configs[name]}, config=name, seed=seed), script=script)
            if row is None:
                continue
            rows.append(row)
            append_row(results, row)
            log(f"[{name} seed {seed}] {describe(row)}")
    return rows


# -------------------------------------------------------------------------------------------------- report
def mean_std(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def window_accuracy(row: dict, window: int, last: bool = True) -> float:
    """Mean sampled accuracy over the run's first or last `window` updates."""
    curve = row["sampled_accuracy"][-window:] if last else row["sampled_accuracy"][:window]
    values = [x for x in curve if x is not None]
    return sum(values) / len(values) if values else float("nan")


def table(rows: list[dict], window: int = 5) -> str:
    lines = [
        "| config | seeds | accuracy before | accuracy after | gain | sampled accuracy, first "
        f"{window} updates | last {window} updates | seconds/run | seconds/update |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == name]
        before = [r["accuracy_before"] for r in mine]
        after = [r["accuracy_after"] for r in mine]
        gain = [a - b for a, b in zip(after, before)]
        first = [window_accuracy(r, window, last=False) for r in mine]
        last = [window_accuracy(r, window) for r in mine]
        seconds = statistics.mean(r["seconds"] for r in mine)
        per_update = statistics.mean(r["seconds_per_update"] for r in mine)
        label = "trl (TRL 1.12)" if name == TRL else name
        lines.append(
            f"| {label} | {len(mine)} | {mean_std(before)} | {mean_std(after)} | {mean_std(gain)} | "
            f"{mean_std(first)} | {mean_std(last)} | {seconds:.1f} | {per_update:.2f} |"
        )
    return "\n".join(lines)


def mean_curves(mine: list[dict]) -> tuple[list[float], list[tuple[int, float]]]:
    """(mean sampled accuracy per update, 3-update moving average; [(update, mean eval accuracy)], update 0 the
    SFT policy) over the runs of one config."""
    curves = [[float("nan") if x is None else x for x in r["sampled_accuracy"]] for r in mine]
    length = min(len(c) for c in curves)
    mean = [statistics.mean(c[i] for c in curves) for i in range(length)]
    smooth = [statistics.mean(mean[max(0, i - 2) : i + 1]) for i in range(length)]
    points = [dict([(0, r["accuracy_before"])] + [tuple(e) for e in r["eval_accuracy"]]) for r in mine]
    steps = sorted(u for u in points[0] if all(u in p for p in points))
    return smooth, [(u, statistics.mean(p[u] for p in points)) for u in steps]


def plot(rows: list[dict], path: str) -> None:
    """Mean sampled accuracy per update (left) and mean greedy eval accuracy (right), one line per config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5))
    colours = plt.get_cmap("tab20").colors
    for index, name in enumerate(dict.fromkeys(r["config"] for r in rows)):
        sampled, evals = mean_curves([r for r in rows if r["config"] == name])
        if name in (TRL, "trl_ppo"):
            style = dict(color="black" if name == TRL else "tab:blue", linewidth=2.5)
        else:
            style = dict(color=colours[(2 * index + 3) % 20], linewidth=1.2, linestyle=("-", "--", ":")[index % 3])
        label = "trl (TRL 1.12)" if name == TRL else name
        left.plot(range(1, len(sampled) + 1), sampled, label=label, **style)
        right.plot([u for u, _ in evals], [a for _, a in evals], marker="o", markersize=3, **style)
    left.set(xlabel="update", ylabel="correct among sampled responses", title="Sampled accuracy (3-update mean)")
    right.set(xlabel="update", ylabel="greedy accuracy, held-out problems", title="Eval accuracy (update 0: SFT)")
    left.legend(fontsize=7, ncol=2)
    figure.suptitle(f"Mean over seeds {sorted({r['seed'] for r in rows})}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


# --------------------------------------------------------------------------------------------- orchestration
def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def missing_flags(name: str) -> list[str]:
    """The config's flags that trl_ppo's PPOConfig does not have (yet)."""
    from trl_ppo import PPOConfig

    fields = {f.name for f in dataclasses.fields(PPOConfig)}
    return [] if name == TRL else [flag for flag in CONFIGS[name] if flag not in fields]


def run_arguments(doc: str, results: str, output_dir: str, updates: int) -> argparse.ArgumentParser:
    """The arguments of a benchmark whose runs are subprocesses over seeds (`run_worker`); `results`: the default
    of --results, a path (the calling script's folder joined to its rows file)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--updates", type=int, default=None, help=f"Updates per run (default {updates}).")
    parser.add_argument("--results", default=results)
    parser.add_argument("--output_dir", default=output_dir, help="SFT cache and run folders.")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per process (2 at most on a shared laptop CPU)."
    )
    parser.add_argument("--report", action="store_true", help="Train nothing: the table of the rows in --results.")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser


def parse_args():
    results = os.path.join(HERE, "learning_results.jsonl")
    parser = run_arguments(__doc__, results, "/tmp/trl_ppo_learning", PPO["updates"])
    names = list(CONFIGS) + [TRL]
    parser.add_argument("--configs", nargs="+", choices=names, default=None, help="Default: all of them.")
    parser.add_argument("--eval_every", type=int, default=10, help="Greedy eval every N updates (0: never).")
    parser.add_argument("--smoke", action="store_true", help="CI form: tiny SFT, 2 updates, 1 seed, 3 runs.")
    parser.add_argument("--plot", default=None, help="Write the mean curves to this PNG (with --report too).")
    return parser.parse_args()


def plan(cli) -> tuple[list[str], dict, task.SFTSettings]:
    """(configs to run, PPO hyper-parameters, SFT settings); configs whose flags trl_ppo lacks are left out."""
    ppo, sft = (dict(SMOKE_PPO), SMOKE_SFT) if cli.smoke else (dict(PPO), SFT)
    if cli.updates:
        ppo["updates"] = cli.updates
    if cli.configs:
        configs = cli.configs
    elif cli.smoke:  # defaults, the first option trl_ppo has, TRL
        configs = ["trl_ppo"] + [n for n in list(CONFIGS)[1:] if CONFIGS[n] and not missing_flags(n)][:1] + [TRL]
    else:
        configs = list(CONFIGS) + [TRL]
    if TRL in configs and importlib.util.find_spec("trl") is None:
        print("skipped trl: TRL 1.12 is not installed (`pip install -e '.[bench]'`)", file=sys.stderr)
        configs = [n for n in configs if n != TRL]
    for name in configs:
        if missing_flags(name):
            print(f"skipped {name}: trl_ppo.PPOConfig has no {', '.join(missing_flags(name))}", file=sys.stderr)
    return [n for n in configs if not missing_flags(n)], ppo, sft


def report(path: str, plot_path: str | None, smoke: bool) -> None:
    """The table (and plot) of the rows already in `path`, smoke runs or not, in the order of CONFIGS."""
    with open(path) as lines:
        rows = [row for row in map(json.loads, lines) if row["smoke"] == smoke]
    order = {name: i for i, name in enumerate(list(CONFIGS) + [TRL])}
    rows.sort(key=lambda row: order.get(row["config"], len(order)))
    print(table(rows))
    if plot_path and rows:
        plot(rows, plot_path)


def main() -> None:
    cli = parse_args()
    if serve_worker(cli.worker, run_one):
        return
    if cli.report:
        report(cli.results, cli.plot, cli.smoke)
        return
    import torch

    torch.set_num_threads(cli.threads)
    configs, ppo, sft = plan(cli)
    seeds = cli.seeds[:1] if cli.smoke else cli.seeds
    tokenizer = task.build_char_tokenizer()
    sft_path = task.train_sft(tokenizer, task.split_problems()[1], sft, cli.output_dir, log=log)
    spec = dict(ppo=ppo, sft=dataclasses.asdict(sft), sft_path=sft_path, output_dir=cli.output_dir)
    spec.update(threads=cli.threads, prompts=NUM_PROMPTS, eval_every=1 if cli.smoke else cli.eval_every)
    rows = []
    for seed in seeds:
        for name in configs:
            row = run_worker(dict(spec, config=name, seed=seed, smoke=cli.smoke))
            if row is None:
                continue
            rows.append(row)
            append_row(cli.results, row)
            before, after = row["accuracy_before"], row["accuracy_after"]
            log(f"[{name} seed {seed}] greedy accuracy {before:.3f} -> {after:.3f} in {row['seconds']:.1f}s")
    print(f"\n{len(rows)} runs appended to {cli.results}\n")
    print(table(rows))
    if cli.plot and rows:
        plot(rows, cli.plot)
    if len(rows) < len(configs) * len(seeds):
        sys.exit(1)


if __name__ == "__main__":
    main()

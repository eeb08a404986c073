"""trl_ppo against TRL 1.12's PPO trainer, side by side: episodes per second, peak memory, and learning parity.

    python benchmark/speed/bench_ppo.py --shape tiny                          # CPU: both trainers, alternated
    python benchmark/speed/bench_ppo.py --shape 160m 1b --precision fp32 bf16  # GPU: every shape x precision
    python benchmark/speed/bench_ppo.py --parity --shape tiny                  # 20 updates x 3 seeds, score gain
    accelerate launch --config_file examples/accelerate_configs/deepspeed_zero2.yaml --num_processes 1 \
        benchmark/speed/bench_ppo.py --shape 160m --precision bf16 --trainers trl_ppo   # trl_ppo under a launcher

The config is the one of the reference figures in issue 7: random-init GPT-NeoX models of the pythia shapes
built from config (policy; value and reward models of the same shape; the reference a frozen copy of the
policy), batch 64 = 16 x 4 accumulation, 4 PPO epochs, `response_length` 53, no stop token, prompts of 32-64
random tokens. Both trainers get the same models (same seed), tokenizer, prompts and PPO hyper-parameters, each
with its own defaults otherwise (TRL's default turns gradient checkpointing on; `--trl_ppo_flags` adds
trl_ppo options such as `train_forward_batch_size`). TRL's bf16 is switched on the way its own docs say,
through `ACCELERATE_MIXED_PRECISION=bf16`.

Each measurement runs in its own subprocess (so peak memory, CUDA peak allocated or CPU max RSS, is that
trainer's alone), trainers alternated within each repeat. Episodes/s is the steady state: the first update
(warm-up, compilation) is excluded. Results are printed as a table and appended as JSON lines to `--results`
(read by `benchmark/speed/plot_results.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import time

SHAPES = {  # hidden size, layers, heads, vocabulary (the pythia family's, vocabulary padded to 50304)
    "tiny": (64, 2, 4, 512),
    "tiny-50k": (64, 2, 4, 50304),  # the tiny backbone with the pythia vocabulary: the logits dominate memory
    "160m": (768, 12, 12, 50304),
    "410m": (1024, 24, 16, 50304),
    "1b": (2048, 16, 8, 50304),
}
TRAINERS = ("trl_ppo", "trl")
WALL_CLOCK_METRICS = ("eps", "train_runtime", "train_episodes_per_second", "train_samples_per_second")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmark/: rows.py
from rows import append_row, print_row  # noqa: E402


# ------------------------------------------------------------------------------------------ one measurement
def build_models(shape: str, tokenizer, seed: int, reward_scale: float = 1.0):
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXForSequenceClassification

    hidden, layers, heads, vocab = SHAPES[shape]
    config = GPTNeoXConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=2048,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    # Initialised on the GPU when there is one (the same draws for both trainers; seconds instead of minutes at 1b).
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        policy = GPTNeoXForCausalLM(config)
        value_model = GPTNeoXForSequenceClassification(config)
        reward_model = GPTNeoXForSequenceClassification(config)
    with torch.no_grad():  # still a random model; larger scores make 20 updates enough to see learning
        reward_model.score.weight.mul_(reward_scale)
    return policy, value_model, reward_model


def random_prompts(vocab: int, count: int, seed: int = 0):
    """`count` prompts of 32-64 token ids drawn above the tokenizer's special tokens (ids 0-2)."""
    import torch
    from datasets import Dataset

    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(32, 65, (count,), generator=generator)
    return Dataset.from_dict(
        {"input_ids": [torch.randint(3, vocab, (int(n),), generator=generator).tolist() for n in lengths]}
    )


def parse_flags(text: str) -> dict:
    """`"a=1 b=true"` -> `{"a": 1, "b": True}` (ints, floats, booleans, else strings)."""
    flags = {}
    for item in shlex.split(text or ""):
        key, _, value = item.partition("=")
        for cast in (int, float):
            try:
                flags[key] = cast(value)
                break
            except ValueError:
                continue
        else:
            flags[key] = {"true": True, "false": False}.get(value.lower(), value)
    return flags


def measure(cli) -> dict:
    """Train `cli.trainer` for `cli.updates + 1` updates in this process; -> the result row."""
    import torch
    from transformers import TrainerCallback

    from trl_ppo.default_job import build_word_tokenizer

    class UpdateLog(TrainerCallback):
        def __init__(self) -> None:
            self.times, self.scores, self.logs, self.save_seconds = [], [], [], []

        def on_train_begin(self, args, state, control, **kwargs):  # after a resumed run's checkpoint is loaded
            self.times, self.first_update = [time.perf_counter()], state.global_step + 1

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            if cli.stop_after and state.global_step >= cli.stop_after:  # as if preempted: resume goes on from here
                control.should_training_stop = True

        def on_save(self, args, state, control, **kwargs):  # called after the checkpoint is written
            self.save_seconds.append(round(time.perf_counter() - self.times[-1], 2))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "objective/scores" in logs:
                self.scores.append(logs["objective/scores"])
            if logs:  # every logged metric but the wall-clock ones, for before/after comparisons
                self.logs.append({k: v for k, v in logs.items() if k not in WALL_CLOCK_METRICS})

    on_gpu = torch.cuda.is_available()
    tokenizer = build_word_tokenizer()
    policy, value_model, reward_model = build_models(cli.shape, tokenizer, cli.seed, cli.reward_scale)
    batch = cli.per_device_train_batch_size * cli.gradient_accumulation_steps
    common = dict(
        output_dir=os.path.join(cli.output_dir, cli.trainer),
        per_device_train_batch_size=cli.per_device_train_batch_size,
        gradient_accumulation_steps=cli.gradient_accumulation_steps,
        total_episodes=batch * (cli.updates + 1),
        num_ppo_epochs=4,
        response_length=53,
        local_rollout_forward_batch_size=batch,
        num_sample_generations=0,
        learning_rate=cli.learning_rate,
        seed=cli.seed,
        save_strategy="steps" if cli.save_steps else "no",
        save_steps=cli.save_steps or 500,
        report_to="none",
        logging_steps=1,
        bf16=cli.precision == "bf16",
        tf32=True if cli.tf32 else None,
        use_cpu=not on_gpu,
        disable_tqdm=True,
    )
    dataset = random_prompts(SHAPES[cli.shape][3], cli.prompts or batch * 4, seed=cli.seed)
    log = UpdateLog()
    if cli.trainer == "trl":
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        from trl.experimental.ppo import PPOConfig, PPOTrainer

        if cli.precision == "bf16":  # TRL builds its own Accelerator, which reads the precision from here
            os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16"
        config = PPOConfig(**common)
        ref_model = None  # TRL copies the policy
    else:
        from trl_ppo import PPOConfig, PPOTrainer
        from trl_ppo.distributed import deepspeed_zero_stage
        from trl_ppo.fsdp import fsdp_version

        config = PPOConfig(**common, ddp_backend=cli.ddp_backend, **parse_flags(cli.trl_ppo_flags))
        ref_model = None  # trl_ppo copies the policy too
    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref_model,
        reward_model=reward_model,
        value_model=None if getattr(config, "advantage_estimator", "gae") != "gae" else value_model,  # critic-free
        train_dataset=dataset,
        callbacks=[log],
    )
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    trainer.train(**({"resume_from_checkpoint": True} if cli.resume else {}))  # TRL's `train()` takes no such argument
    steady = log.times[2:]  # from the end of the warm-up update
    seconds = steady[-1] - log.times[1]
    if on_gpu:
        peak, peak_kind = torch.cuda.max_memory_allocated(), "cuda_max_allocated"
    else:
        peak, peak_kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "max_rss"
    world = trainer.accelerator.num_processes
    if cli.log_history:
        with open(cli.log_history, "w") as handle:
            json.dump(log.logs, handle, indent=1)
    return {
        "trainer": cli.trainer,
        "shape": cli.shape,
        "precision": cli.precision + ("+tf32" if cli.tf32 else ""),
        "seed": cli.seed,
        "device": torch.cuda.get_device_name() if on_gpu else cpu_name(),
        "episodes_per_second": round(batch * world * len(steady) / seconds, 3),
        "seconds_per_update": round(seconds / len(steady), 4),
        "warmup_seconds": round(log.times[1] - log.times[0], 2),
        "peak_memory_gib": round(peak / 2**30, 3),
        "peak_memory_kind": peak_kind,
        "scores": [round(s, 5) for s in log.scores],
        "processes": world,
        "deepspeed_zero_stage": deepspeed_zero_stage(trainer.accelerator) if cli.trainer == "trl_ppo" else None,
        "fsdp_version": fsdp_version(trainer.accelerator) if cli.trainer == "trl_ppo" else None,
        "trl_ppo_flags": cli.trl_ppo_flags if cli.trainer == "trl_ppo" else "",
        **({"checkpoint_seconds": log.save_seconds} if cli.save_steps else {}),
        **({"resumed_at_update": log.first_update, "final_update": trainer.state.global_step} if cli.resume else {}),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }


def cpu_name() -> str:
    """ "cpu: <model name>, <n> cores", so that rows from different CPU machines stay apart."""
    model = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as info:
            model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "")
    return f"cpu: {model or 'unknown'}, {os.cpu_count()} cores"


# --------------------------------------------------------------------------------------------- orchestration
def run_worker(cli, trainer: str, shape: str, precision: str, seed: int, updates: int) -> dict | None:
    """One measurement in a fresh subprocess; -> its row, or None (with its output shown) when it failed."""
    command = [sys.executable, os.path.abspath(__file__), "--worker", trainer, "--shape", shape]
    command += ["--precision", precision, "--seed", str(seed), "--updates", str(updates)]
    command += ["--learning_rate", str(cli.learning_rate), "--output_dir", cli.output_dir]
    command += ["--reward_scale", str(cli.reward_scale)] + (["--prompts", str(cli.prompts)] if cli.prompts else [])
    command += ["--per_device_train_batch_size", str(cli.per_device_train_batch_size)]
    command += ["--gradient_accumulation_steps", str(cli.gradient_accumulation_steps)]
    command += ["--trl_ppo_flags", cli.trl_ppo_flags] + (["--tf32"] if cli.tf32 else [])
    if cli.log_history:  # one file per trainer, shape, precision and seed
        command += ["--log_history", f"{cli.log_history}.{trainer}.{shape}.{precision}.{seed}.json"]
    done = subprocess.run(command, capture_output=True, text=True)
    rows = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not rows:
        print(f"[{trainer} {shape} {precision} seed {seed}] failed (exit {done.returncode}):", file=sys.stderr)
        print((done.stdout + done.stderr)[-4000:], file=sys.stderr)
        return None
    row = json.loads(rows[-1])
    print_row({k: v for k, v in row.items() if k != "scores"}, file=sys.stderr)
    return row


def trl_available() -> bool:
    try:
        import trl
    except ImportError:
        return False
    return trl.__version__ == "1.12.0"


def speed_table(rows: list[dict]) -> str:
    """Markdown table: per shape x precision, each trainer's median episodes/s and peak memory, and the ratios."""
    lines = [
        "| shape | precision | trl_ppo episodes/s | TRL episodes/s | speed-up "
        "| trl_ppo peak GiB | TRL peak GiB | memory ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for shape, precision in dict.fromkeys((r["shape"], r["precision"]) for r in rows):  # precision may be fp32+tf32
        cell = {}
        for trainer in TRAINERS:
            mine = [r for r in rows if (r["shape"], r["precision"], r["trainer"]) == (shape, precision, trainer)]
            if mine:
                eps = sorted(r["episodes_per_second"] for r in mine)[len(mine) // 2]
                cell[trainer] = (eps, max(r["peak_memory_gib"] for r in mine))
        ours, theirs = cell.get("trl_ppo"), cell.get("trl")
        speedup = f"{ours[0] / theirs[0]:.2f}x" if ours and theirs else "-"
        memory = f"{ours[1] / theirs[1]:.2f}x" if ours and theirs else "-"
        show = lambda c, i: f"{c[i]:.2f}" if c else "-"  # noqa: E731
        lines.append(
            f"| {shape} | {precision} | {show(ours, 0)} | {show(theirs, 0)} | {speedup} | "
            f"{show(ours, 1)} | {show(theirs, 1)} | {memory} |"
        )
    return "\n".join(lines)


def score_gain(scores: list[float], window: int = 5) -> float:
    """Mean `objective/scores` of the last `window` updates minus that of the first `window`."""
    window = min(window, len(scores) // 2) or 1
    return sum(scores[-window:]) / window - sum(scores[:window]) / window


def parity_table(rows: list[dict]) -> str:
    lines = ["| trainer | seeds | score gain per seed | mean gain |", "|---|---|---|---|"]
    for trainer in TRAINERS:
        mine = [r for r in rows if r["trainer"] == trainer]
        if mine:
            gains = [score_gain(r["scores"]) for r in mine]
            seeds = ", ".join(str(r["seed"]) for r in mine)
            per_seed = ", ".join(f"{g:+.4f}" for g in gains)
            lines.append(f"| {trainer} | {seeds} | {per_seed} | {sum(gains) / len(gains):+.4f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=["tiny"])
    parser.add_argument("--precision", nargs="+", choices=["fp32", "bf16"], default=["fp32"])
    parser.add_argument("--trainers", default="trl_ppo,trl", help="Comma-separated: trl_ppo, trl.")
    parser.add_argument("--repeats", type=int, default=1, help="Alternated measurements per trainer and config.")
    parser.add_argument("--updates", type=int, default=None, help="Measured updates after the warm-up one.")
    parser.add_argument(
        "--parity",
        action="store_true",
        help="Learning parity: 20 updates per seed on one batch of prompts against a random reward model with larger "
        "scores, learning rate 1e-3; reports each trainer's score gain (last 5 updates minus first 5).",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="Seeds of --parity.")
    parser.add_argument("--learning_rate", type=float, default=None, help="Default 3e-6; 1e-3 with --parity.")
    parser.add_argument(
        "--reward_scale",
        type=float,
        default=None,
        help="Multiplies the random reward head (default 1; 50 with --parity).",
    )
    parser.add_argument(
        "--prompts",
        type=int,
        default=None,
        help="Distinct prompts (default 4 batches; with --parity one batch, so "
        "every update scores the same prompts and the gain is not drowned by prompt-to-prompt differences).",
    )
    parser.add_argument("--tf32", action="store_true", help="TF32 matrix products for both trainers (CUDA).")
    parser.add_argument("--per_device_train_batch_size", type=int, default=16)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=4)
    parser.add_argument(
        "--trl_ppo_flags", default="", help='Extra trl_ppo PPOConfig fields, e.g. "train_forward_batch_size=64".'
    )
    parser.add_argument("--results", default=os.path.join(HERE, "results.jsonl"), help="JSON lines appended here.")
    parser.add_argument("--output_dir", default="/tmp/trl_ppo_bench")
    parser.add_argument("--save_steps", type=int, default=0, help="Write a checkpoint every N updates (0: none).")
    parser.add_argument(
        "--stop_after", type=int, default=0, help="Stop the run after this update (0: run all --updates + 1)."
    )
    parser.add_argument(
        "--resume", action="store_true", help="Resume from the newest checkpoint in --output_dir/<trainer>."
    )
    parser.add_argument("--ddp_backend", default=None, help="e.g. gloo for DeepSpeed on CPU (in-process runs).")
    parser.add_argument(
        "--log_history",
        default=None,
        help="Write every logged metric (full precision, wall-clock ones left out) of each run to "
        "<this>.<trainer>.<shape>.<precision>.<seed>.json: to check that a change moves no number.",
    )
    parser.add_argument("--worker", choices=TRAINERS, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.learning_rate is None:
        cli.learning_rate = 1e-3 if cli.parity else 3e-6
    if cli.prompts is None and cli.parity:
        cli.prompts = cli.per_device_train_batch_size * cli.gradient_accumulation_steps
    if cli.reward_scale is None:
        cli.reward_scale = 50.0 if cli.parity else 1.0
    if cli.updates is None:
        cli.updates = 19 if cli.parity else 4
    trainers = [t.strip() for t in cli.trainers.split(",") if t.strip()]
    unknown = set(trainers) - set(TRAINERS)
    if unknown:
        parser.error(f"unknown trainers {sorted(unknown)}; choose from {TRAINERS}")
    if cli.worker or "WORLD_SIZE" in os.environ:  # one measurement in this process; under accelerate launch, trl_ppo
        cli.trainer, cli.shape, cli.precision = cli.worker or "trl_ppo", cli.shape[0], cli.precision[0]
        row = measure(cli)
        if int(os.environ.get("RANK", "0")) == 0:
            print_row(row)
        return
    if "trl" in trainers and not trl_available():
        parser.error("TRL 1.12.0 is not installed: `pip install -e '.[bench]'`, or pass --trainers trl_ppo")

    rows = []
    seeds = cli.seeds if cli.parity else [0]
    for shape in cli.shape:
        for precision in cli.precision:
            for repeat in range(cli.repeats):
                for seed in seeds:
                    order = trainers if repeat % 2 == 0 else trainers[::-1]
                    for trainer in order:
                        row = run_worker(cli, trainer, shape, precision, seed, cli.updates)
                        if row:
                            row["parity"] = cli.parity
                            rows.append(row)
    for row in rows:
        append_row(cli.results, row)
    print(f"\n{len(rows)} runs appended to {cli.results}")
    print(parity_table(rows) if cli.parity else speed_table(rows))
    if len(rows) < len(trainers) * len(cli.shape) * len(cli.precision) * len(seeds) * cli.repeats:
        sys.exit(1)


if __name__ == "__main__":
    main()

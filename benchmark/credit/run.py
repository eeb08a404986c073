"""One cell of the credit benchmark: one task x one estimator x one seed, trained and evaluated; a JSON row appended.

    OMP_NUM_THREADS=1 python benchmark/credit/run.py --task key_to_door --estimator grpo --seed 0 --out rows.jsonl
    OMP_NUM_THREADS=1 python benchmark/credit/run.py --task chain_4 --estimator gae --gae_level turn --out rows.jsonl

A row already in `--out` for the same task, estimator, gae_level, seed, learning rate, updates, batch and group
size is skipped, so a long sweep can be run again after a stop. The start is the task's SFT policy
(`policy.train_sft`, cached in `--work_dir`); 'gae' runs with a value model (the SFT backbone and a fresh score
head, or with `--value_init random` the same architecture freshly initialised) and one sample per prompt, the
critic-free estimators with `--num_generations` samples per prompt; every method sees `updates x batch` episodes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)  # tasks/policy here; agent_task, guess_game in agents/, learning_task in learning/
sys.path[:0] = [HERE, BENCH, os.path.join(BENCH, "agents"), os.path.join(BENCH, "learning")]  # rows.py in BENCH
import policy  # noqa: E402
import tasks  # noqa: E402
from rows import append_row, has_row  # noqa: E402

ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_baseline")
LEVEL = 0.8  # the success level whose episodes-to-reach a row records
KEY_FIELDS = ("task", "estimator", "gae_level", "seed", "lr", "updates", "episodes_per_update", "num_generations",
              "config", "value_init")
EV_TURN_1 = "val/explained_variance/turn_1"  # how much of the first turn's return the critic predicts


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=sorted(tasks.TASKS), required=True)
    parser.add_argument("--estimator", choices=ESTIMATORS, required=True)
    parser.add_argument("--gae_level", choices=("token", "turn"), default="token", help="With --estimator gae.")
    parser.add_argument("--value_init", choices=("sft", "random"), default="sft", help="With --estimator gae: the "
                        "value model is the SFT policy's backbone with a fresh score head, or all of it fresh.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--updates", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16, help="Episodes per update.")
    parser.add_argument("--num_generations", type=int, default=4, help="Group size of the critic-free estimators.")
    parser.add_argument("--eval_episodes", type=int, default=64)
    parser.add_argument("--sft_steps", type=int, default=policy.SFTSettings.steps)
    parser.add_argument("--config", nargs="+", metavar="FIELD=VALUE", help="More PPOConfig fields (e.g. lam=1.0 "
                        "critic_warmup_steps=20), in the row and its key: the critic's variants in RESULTS.")
    parser.add_argument("--out", required=True, help="JSONL file the row is appended to.")
    parser.add_argument("--work_dir", default="/tmp/trl_ppo_credit", help="SFT policies and run folders.")
    args = parser.parse_args(argv)
    if args.estimator != "gae":
        args.gae_level = args.value_init = None  # one advantage per episode: no level, no critic
    else:
        args.num_generations = None  # one sample per prompt
    args.episodes_per_update = args.batch  # the row's name
    args.config = dict(sorted(map(parse_field, args.config))) if args.config else None
    if args.config:
        import dataclasses

        from trl_ppo import PPOConfig

        unknown = set(args.config) - {f.name for f in dataclasses.fields(PPOConfig)}
        if unknown:
            parser.error(f"--config: PPOConfig has no field {', '.join(sorted(unknown))}")
    return args


def parse_field(text: str) -> tuple[str, object]:
    """"lam=1.0" -> ("lam", 1.0): the value read as JSON where it parses (numbers, true, null), else a string."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"--config takes FIELD=VALUE, got {text!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def budget(task: str) -> int:
    """`response_length`: every turn fits (a letter and its stop token, then an observation of under 14 tokens)."""
    return 16 * (tasks.TASKS[task]().steps + 1)


def dataset(args):
    from datasets import Dataset

    rows = args.updates * args.batch  # one row per prompt; a group's members share a row (and draw their own start)
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": tasks.PROMPT}]] * rows,
                              "seed": [args.seed * 1_000_000 + i for i in range(rows)]})


def run_dir(args) -> str:
    """The cell's own folder: cells that run side by side must not share one (trl_ppo's run lock refuses that)."""
    extra = "".join(f"-{name}{value}" for name, value in (args.config or {}).items())
    extra += "-random_critic" if args.value_init == "random" else ""
    return os.path.join(args.work_dir, "runs",
                        f"{args.task}-{args.estimator}-{args.gae_level}-{args.seed}-{args.lr:g}{extra}")


def trainer(args, tokenizer, model, sft_path: str):
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from trl_ppo import PPOConfig, PPOTrainer

    critic = args.estimator == "gae"
    groups = dict(num_generations=args.num_generations) if args.num_generations else {}
    config = PPOConfig(
        output_dir=run_dir(args),
        per_device_train_batch_size=args.batch, gradient_accumulation_steps=1, learning_rate=args.lr,
        total_episodes=args.updates * args.batch, num_ppo_epochs=2, temperature=1.0, seed=args.seed,
        response_length=budget(args.task), max_turns=tasks.TASKS[args.task]().steps + 1, stop_token="eos",
        missing_eos_penalty=1.0, advantage_estimator=args.estimator, gae_level=args.gae_level or "token",
        local_rollout_forward_batch_size=args.batch, num_sample_generations=0, save_strategy="no",
        report_to="none", logging_steps=1, bf16=False, use_cpu=True, disable_tqdm=True, **groups, **(args.config or {}),
    )
    value_model = None
    if critic and args.value_init == "random":
        torch.manual_seed(args.seed)
        value_model = AutoModelForSequenceClassification.from_config(
            AutoConfig.from_pretrained(sft_path, num_labels=1))
    elif critic:
        value_model = AutoModelForSequenceClassification.from_pretrained(sft_path, num_labels=1)
        torch.manual_seed(args.seed)
        torch.nn.init.normal_(value_model.score.weight, std=value_model.config.initializer_range)
    return PPOTrainer(args=config, processing_class=tokenizer, model=model, ref_model=None, value_model=value_model,
                      train_dataset=dataset(args), environment_factory=tasks.TASKS[args.task])


def evaluation(model, tokenizer, args) -> dict:
    common = dict(budget=budget(args.task), episodes=args.eval_episodes, seed=args.seed)
    return {"greedy": policy.evaluate(model, tokenizer, args.task, temperature=None, **common)["success"],
            "sampled": policy.evaluate(model, tokenizer, args.task, temperature=1.0, **common)["success"]}


def episodes_to_reach(curve: list[float], per_update: int, level: float = LEVEL) -> int | None:
    """Episodes until an update's training success first reached `level` (None: never)."""
    return next(((update + 1) * per_update for update, value in enumerate(curve) if value >= level), None)


def train_ppo(args, tokenizer, model, sft_path: str) -> tuple[list[float], dict]:
    """Train the cell with trl_ppo -> (the success curve, and with a critic the first turn's explained variance
    per update, None where it was undefined)."""
    train = trainer(args, tokenizer, model, sft_path)
    train.train()
    # The environment's score is 1.0 on success, 0.0 otherwise (turn rewards are separate): its batch mean is the
    # share of the update's episodes that succeeded.
    updates = [h for h in train.state.log_history if "objective/scores/environment" in h]
    curve = [round(float(h["objective/scores/environment"]), 4) for h in updates]
    if args.estimator != "gae":
        return curve, {}
    return curve, {"ev_turn_1": [round(float(h[EV_TURN_1]), 4) if EV_TURN_1 in h else None for h in updates]}


def run(args, train=train_ppo) -> dict:
    """SFT (cached), evaluate, `train(args, tokenizer, model, sft_path)` -> (curve, more row fields), evaluate ->
    the row."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    cpu = time.process_time()
    tokenizer = tasks.build_tokenizer()
    settings = policy.SFTSettings(steps=args.sft_steps)
    sft_path = policy.train_sft(args.task, tokenizer, settings, os.path.join(args.work_dir, "sft"))
    model = AutoModelForCausalLM.from_pretrained(sft_path)
    before = evaluation(model, tokenizer, args)
    curve, more = train(args, tokenizer, model, sft_path)
    after = evaluation(model, tokenizer, args)
    return {
        "task": args.task, "estimator": args.estimator, "gae_level": args.gae_level, "seed": args.seed,
        "lr": args.lr, "updates": args.updates, "episodes_per_update": args.batch,
        "num_generations": args.num_generations, "config": args.config, "value_init": args.value_init,
        "success_curve": curve, "before": before, "final": after,
        f"episodes_to_{LEVEL}": episodes_to_reach(curve, args.batch),
        "cpu_seconds": round(time.process_time() - cpu, 1), "sft": settings.key(args.task), **more,
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
    }


def cell(args, train=train_ppo) -> None:
    """Run the cell `args` names and append its row to `args.out`, unless a row for it is already there."""
    if has_row(args.out, vars(args), KEY_FIELDS):
        print(f"skipped: a row for {({name: vars(args)[name] for name in KEY_FIELDS})} is already in {args.out}")
        return
    row = run(args, train)
    append_row(args.out, row)
    print(f"{args.task} {args.estimator} {args.gae_level or ''} seed {args.seed}: success {row['before']} -> "
          f"{row['final']}, curve {row['success_curve']}, {row['cpu_seconds']}s CPU")


def main(argv=None) -> None:
    cell(parse_args(argv))


if __name__ == "__main__":
    main()

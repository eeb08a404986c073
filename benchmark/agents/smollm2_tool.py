"""A real chat model learns a tool (issue 43, part 4): one cell, an estimator x a seed, trained from the cached
SmolLM2-135M-Instruct warm start on "(a * b) + c" with `multiply` and `add`, evaluated greedily on the 100 held-out
problems; a JSON row appended to `--out`.

    OMP_NUM_THREADS=1 python benchmark/agents/smollm2_tool.py --estimator gae --seed 0
    OMP_NUM_THREADS=1 python benchmark/agents/smollm2_tool.py --estimator trl_grpo --seed 0

'gae' is PPO with turn-level GAE (lam 1.0) and a value head (zero-initialised); 'grpo', 'rloo' and
'reinforce_baseline' are trl_ppo's critic-free estimators with groups of `--num_generations`; 'trl_grpo' is TRL
1.12's GRPOTrainer with the same tools, template, reward, group size, rate and episode budget, and TRL's own defaults
for its loss and optimizer (no KL term: its `beta` 0, recorded as `kl_coef` 0; no missing-EOS penalty; gradients
clipped to norm 1.0, `Trainer`'s default, where trl_ppo's default is no clipping, as PPOv2's: `--max_grad_norm`
sets either, and the row records it). Every method sees
`--updates x --batch_size` episodes, one optimizer step per update (`--ppo_epochs` more reuse each batch). The warm
start's evaluation is the same for every cell (greedy, cached in the warm start's folder); a row already in `--out`
for the same cell is skipped, and a cell stopped part-way resumes from its last checkpoint (`--save_steps`) when run
again (the row then says `resumed` and counts the CPU seconds of the last process only). `--device cuda` trains in
bf16 on a GPU (`benchmark/speed/gpu_check.sh`'s "agents" step); its row names the card and the peak CUDA memory of
training, and goes to a file of its own (the device is not part of a cell's key).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.join(ROOT, "examples", "scripts"), os.path.dirname(HERE),
                os.path.join(ROOT, "benchmark", "learning")]
import smollm2_tool_agent as agent  # noqa: E402  (the trainer, reward and evaluation of the demo)
from default_job import children_cpu_seconds  # noqa: E402  (the sampler process of `max_staleness`, once joined)
from rows import append_row, has_row  # noqa: E402

task = agent.task
OUT = os.path.join(HERE, "smollm2_tool.jsonl")
KEY_FIELDS = ("estimator", "seed", "learning_rate", "updates", "batch_size", "num_generations", "ppo_epochs",
              "lr_scheduler_type", "kl_coef", "missing_eos_penalty", "max_grad_norm", "skip_zero_gradient_steps",
              "warm_start_settings", "max_staleness", "off_policy_correction", "critic_learning_rate",
              "agent_rollout", "tis_cap", "num_mini_batches", "generation_backend")
# Each trainer's own default: `Trainer`'s 1.0 for TRL's GRPO, none (0) for trl_ppo's (PPOv2 clips nothing).
DEFAULT_MAX_GRAD_NORM = {"trl_grpo": 1.0}
# What TRL logs of the reward at each step (its name: the function's).
TRL_SUCCESS = "rewards/answer_reward/mean"
# ... and what trl_ppo logs of it once per update: its entries are the updates' logs.
SUCCESS = "objective/scores/answer_reward"
SUMMARY = ("success", "tool_call_rate", "calls_per_episode", "tool_errors_per_episode")


def parse_args(argv=None):
    parser = agent.build_parser(__doc__, (*agent.ESTIMATORS, "trl_grpo"))
    parser.add_argument("--out", default=OUT, help="JSONL file the row is appended to")
    parser.set_defaults(max_grad_norm=None)  # then the trainer's own default (DEFAULT_MAX_GRAD_NORM)
    parser.add_argument("--work_dir", default=os.path.join(ROOT, "runs", "smollm2_tool"),
                        help="run folders (checkpoints) and the warm start's cached evaluation")
    args = agent.parse_args(argv, parser)
    if args.estimator == "gae":
        args.num_generations = 1
    if args.estimator == "trl_grpo":
        if args.missing_eos_penalty is not None:
            parser.error("--missing_eos_penalty: TRL's GRPOTrainer has no such penalty")
        if args.skip_zero_gradient_steps:
            parser.error("--skip_zero_gradient_steps: TRL's GRPOTrainer has no such option")
        args.kl_coef = 0.0  # TRL's default `beta`: no KL term
    default_clip = DEFAULT_MAX_GRAD_NORM.get(args.estimator, 0.0)
    if args.max_grad_norm is None:
        args.max_grad_norm = default_clip
    # Settings off their defaults name the folder too, so that a run never resumes another's checkpoints.
    changed = [f"-clip{args.max_grad_norm:g}"] if args.max_grad_norm != default_clip else []
    if args.estimator != "trl_grpo" and args.kl_coef != parser.get_default("kl_coef"):
        changed.append(f"-kl{args.kl_coef:g}")
    if args.skip_zero_gradient_steps:
        changed.append("-skip0")
    if args.max_staleness:
        if args.estimator == "trl_grpo":
            parser.error("--max_staleness: TRL's GRPOTrainer has no such option")
        changed.append(f"-stale{args.max_staleness}{args.off_policy_correction}")
    for name, tag in (("tis_cap", "cap"), ("num_mini_batches", "mb")):
        if getattr(args, name) is not None:
            if args.estimator == "trl_grpo":
                parser.error(f"--{name}: not an option of this comparison with TRL's GRPOTrainer")
            changed.append(f"-{tag}{getattr(args, name):g}")
    if args.critic_learning_rate is not None:
        changed.append(f"-clr{args.critic_learning_rate:g}")
    if args.generation_backend is not None:
        if args.estimator == "trl_grpo":
            parser.error("--generation_backend: not an option of this comparison with TRL's GRPOTrainer")
        changed.append(f"-{args.generation_backend}")
    if args.estimator == "trl_grpo":
        if args.agent_rollout != "continuous":
            parser.error("--agent_rollout: TRL's GRPOTrainer plays its episodes its own way")
        args.agent_rollout = None  # recorded as none of trl_ppo's
    elif args.agent_rollout == "lockstep":
        changed.append("-lockstep")
    if args.device != "cpu":
        changed.append(f"-{args.device}")
    args.output_dir = os.path.join(args.work_dir, f"{args.estimator}-seed{args.seed}-lr{args.learning_rate:g}-"
                                   f"{args.updates}x{args.batch_size}-epochs{args.ppo_epochs}-{args.lr_scheduler_type}"
                                   f"-eos{args.missing_eos_penalty}" + "".join(changed))
    return args


def summary(result: dict) -> dict:
    """An evaluation's numbers and first episode, for the row."""
    return {name: round(result[name], 4) for name in SUMMARY} | {"sample": result["sample"]}


def last_checkpoint(folder: str) -> bool:
    return os.path.isdir(folder) and any(name.startswith("checkpoint-") for name in os.listdir(folder))


def train_trl_ppo(args, tokenizer):
    """trl_ppo's trainer -> (the trained LM, the training success curve, per-update curves for the row: the critic's
    explained variance and, where logged, the sampler/trainer log-prob difference and the off-policy weights)."""
    policy = agent.load_policy(args.warm_start)
    trainer = agent.trainer_for(args, policy, tokenizer)
    sampling = time_sampling(trainer.agents) if not args.max_staleness else {}  # (a sampler process: not here)
    trainer.train(resume_from_checkpoint=True if last_checkpoint(args.output_dir) else None)
    updates = [h for h in trainer.state.log_history if SUCCESS in h]
    curves = {"explained_variance": explained_variance_curves(updates),
              **logged_curves(updates, "rollout/logprob_diff_"), **logged_curves(updates, "offpolicy/")}
    return policy, [round(float(h[SUCCESS]), 4) for h in updates], curves | {"sampling": sampling}


def time_sampling(runner) -> dict:
    """The CPU and wall seconds of playing the training episodes (the sampler's part of each rollout: the turns and
    the tool calls, not the forwards that follow) and the model tokens sampled, summed over the run as it goes:
    the row's `sampling`. Wraps the runner's `_play` (this process's threads, the in-process vLLM engine's too)."""
    totals = {"cpu_seconds": 0.0, "wall_seconds": 0.0, "model_tokens": 0, "episodes": 0}
    play = runner._play

    def timed(episodes, *rest):
        cpu, wall = time.process_time(), time.perf_counter()
        play(episodes, *rest)
        totals["cpu_seconds"] = round(totals["cpu_seconds"] + time.process_time() - cpu, 2)
        totals["wall_seconds"] = round(totals["wall_seconds"] + time.perf_counter() - wall, 2)
        totals["model_tokens"] += sum(sum(episode.model_mask) for episode in episodes)
        totals["episodes"] += len(episodes)

    runner._play = timed
    return totals


def explained_variance_curves(history: list[dict]) -> dict[str, list[float | None]]:
    """The critic's `val/explained_variance` (all tokens, and per turn) at each update (the logs with `SUCCESS`),
    None where it was undefined (all returns equal) -> {"all": [...], "turn_1": [...], ...}."""
    from trl_ppo.critic import EV_METRIC

    updates = [h for h in history if SUCCESS in h]
    names = sorted({k for h in updates for k in h if k.startswith(EV_METRIC)})
    return {name.removeprefix(EV_METRIC).lstrip("/") or "all": [None if h.get(name) is None else round(h[name], 4)
                                                                for h in updates] for name in names}


def logged_curves(history: list[dict], prefix: str) -> dict[str, list[float]]:
    """Each metric named `prefix`* at each update -> {its name less the part before "/": [...]}, only the names
    logged at every update (none: {}). "rollout/logprob_diff_": the sampler's log-probs of its tokens against the
    training forward's; "offpolicy/": the off-policy correction's weights (`off_policy.behaviour_weights`)."""
    updates = [h for h in history if SUCCESS in h]
    names = sorted({k for h in updates for k in h if k.startswith(prefix)})
    return {name.split("/", 1)[1]: [round(h[name], 6) for h in updates] for name in names
            if updates and all(name in h for h in updates)}


def answer_reward(prompts, completions, answer, **columns) -> list[float]:
    """TRL passes conversational completions (messages): the final assistant turn's last number."""
    from agent_task import final_answer

    return [float(agent.last_integer(final_answer(c)) == int(a)) for c, a in zip(completions, answer)]


NO_CRITIC = {"explained_variance": {}}  # TRL's cells: the row's curves of a run without a critic


def train_trl_grpo(args, tokenizer):
    """TRL 1.12's GRPOTrainer -> (the trained LM, the training success curve: the reward's mean at each logged
    step, one per update with `--ppo_epochs 1`, and no critic's curves)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    finished = finished_checkpoint(args.output_dir, args.updates * args.ppo_epochs)
    if finished:  # resumed at its last step, `Trainer` would take one step more (a checkpoint-17 of 16)
        return AutoModelForCausalLM.from_pretrained(finished[0]), curve_of(finished[1]), NO_CRITIC
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    model = AutoModelForCausalLM.from_pretrained(args.warm_start)
    rows = task.split_problems()[1]
    data = Dataset.from_dict({"prompt": [task.prompt_messages(*p) for p in rows],
                              "answer": [task.answer(*p) for p in rows]})
    config = GRPOConfig(
        output_dir=args.output_dir, per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=1,
        learning_rate=args.learning_rate, lr_scheduler_type=args.lr_scheduler_type,
        max_steps=args.updates * args.ppo_epochs, num_iterations=args.ppo_epochs, num_generations=args.num_generations,
        temperature=1.0, max_completion_length=args.response_length, max_tool_calling_iterations=args.max_turns - 1,
        beta=args.kl_coef, max_grad_norm=args.max_grad_norm, seed=args.seed,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500, save_total_limit=1, report_to="none", logging_steps=1,
        bf16=args.device == "cuda", use_cpu=args.device == "cpu", disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=model, args=config, train_dataset=data, reward_funcs=[answer_reward],
                          processing_class=task.rendering_tokenizer(tokenizer), tools=list(task.TOOLS))
    trainer.train(resume_from_checkpoint=True if last_checkpoint(args.output_dir) else None)
    return model, curve_of(trainer.state.log_history), NO_CRITIC  # a resumed run's history too, from its checkpoint


def curve_of(history: list[dict]) -> list[float]:
    """The training success per logged step of TRL's log history."""
    return [round(h[TRL_SUCCESS], 4) for h in history if TRL_SUCCESS in h]


def finished_checkpoint(folder: str, max_steps: int) -> tuple[str, list[dict]] | None:
    """(the newest checkpoint in `folder`, its log history) when it has taken all `max_steps` steps already (the
    run trained whole and stopped before its evaluation), else None."""
    from transformers.trainer_utils import get_last_checkpoint

    newest = get_last_checkpoint(folder) if os.path.isdir(folder) else None
    if newest is None:
        return None
    with open(os.path.join(newest, "trainer_state.json"), encoding="utf-8") as handle:
        state = json.load(handle)
    return (newest, state["log_history"]) if state["global_step"] >= max_steps else None


def run(args, tokenizer) -> dict:
    import torch

    held_out = task.split_problems()[0][: args.held_out]
    before = summary(agent.warm_start_evaluation(args, tokenizer, held_out))
    resumed = last_checkpoint(args.output_dir)  # then the CPU seconds are this process's only
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    cpu, wall, children = time.process_time(), time.perf_counter(), children_cpu_seconds()
    model, curve, curves = (train_trl_grpo if args.estimator == "trl_grpo" else train_trl_ppo)(args, tokenizer)
    train_cpu = time.process_time() - cpu + children_cpu_seconds() - children
    train_wall = time.perf_counter() - wall
    peak = round(torch.cuda.max_memory_allocated() / 2**30, 3) if args.device == "cuda" else None
    peak_rss = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)  # KiB on Linux; of the process
    after = summary(agent.evaluate(model, tokenizer, held_out, args))
    return {
        "estimator": args.estimator, "seed": args.seed, "learning_rate": args.learning_rate, "updates": args.updates,
        "batch_size": args.batch_size, "num_generations": args.num_generations, "kl_coef": args.kl_coef,
        "ppo_epochs": args.ppo_epochs, "lr_scheduler_type": args.lr_scheduler_type,
        "missing_eos_penalty": args.missing_eos_penalty, "max_grad_norm": args.max_grad_norm,
        "skip_zero_gradient_steps": args.skip_zero_gradient_steps, "warm_start_settings": args.warm_start_settings,
        "held_out": len(held_out),
        "before": before, "after": after, "training_success": curve, **curves,
        "train_cpu_seconds": round(train_cpu, 1), "train_wall_seconds": round(train_wall, 1),
        "episodes_per_wall_second": round(args.updates * args.batch_size / train_wall, 4),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "peak_cuda_gib": peak,
        "peak_rss_gib": peak_rss,
        "max_staleness": args.max_staleness,
        "off_policy_correction": args.off_policy_correction, "critic_learning_rate": args.critic_learning_rate,
        "agent_rollout": args.agent_rollout, "tis_cap": args.tis_cap, "num_mini_batches": args.num_mini_batches,
        "generation_backend": args.generation_backend,
        "resumed": resumed,
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    args.warm_start_settings = task.cached_warm_start(args.model, tokenizer, args.warm_start, args.device)
    if has_row(args.out, vars(args), KEY_FIELDS):
        print(f"skipped: {args.out} has a row for {args.estimator} seed {args.seed}")
        return
    row = run(args, tokenizer)
    append_row(args.out, row)
    print(f"{args.estimator} seed {args.seed}: held-out success {row['before']['success']} -> "
          f"{row['after']['success']}, training {row['train_cpu_seconds']} CPU s")


if __name__ == "__main__":
    main()

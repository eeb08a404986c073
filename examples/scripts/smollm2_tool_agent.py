"""A real chat model learns to use a tool on a CPU (`make demo-agent`): SmolLM2-135M-Instruct, warm-started on the
tool-call format (`smollm2_tool_warm_start.py`, cached in .cache/), trained with PPO to answer "What is (a * b) + c?"
with a `multiply` and an `add` tool that each do one operation, so that every problem needs two calls.

    python examples/scripts/get_smollm2.py .cache/smollm2-135m-instruct
    python examples/scripts/smollm2_tool_agent.py                       # PPO: turn-level GAE, a value head
    python examples/scripts/smollm2_tool_agent.py --estimator grpo      # or rloo, reinforce_baseline

SmolLM2's own chat template has no tool section: the trainer is given the ChatML tool template shipped with trl_ppo
by name (`tool_chat_template="chatml"`); no parser is written here. The reward is 1.0 when the last number of the
model's final turn is (a * b) + c, else 0.0, at the end of the episode only. Greedy success on held-out problems
(never trained on) is printed before and after training, with the tool calls and tool errors per episode and the
CPU seconds of each phase (process time: run with OMP_NUM_THREADS=1 to read them as one core's). The measured
comparison of the estimators is `benchmark/agents/smollm2_tool.py`'s (RESULTS, "A real chat model learns a tool").
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import smollm2_tool_warm_start as task  # noqa: E402  (the problems, the tools, the warm start, the evaluation)

ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_baseline")


# ---------------------------------------------------------------------------------------------- the reward
def last_integer(text: str) -> int | None:
    """The last integer of `text` (thousands separators dropped), or None."""
    numbers = re.findall(r"-?\d+", text.replace(",", ""))
    return int(numbers[-1]) if numbers else None


def is_correct(completion: str, answer: int) -> bool:
    """The last integer of the model's final turn (after its last tool call) is the answer."""
    return last_integer(completion.rsplit("</tool_call>", 1)[-1]) == int(answer)


def answer_reward(prompts, completions, answer, **columns) -> list[float]:
    """1.0 when the final turn's last number is the answer, else 0.0 (`completions`: the model's own tokens)."""
    return [float(is_correct(c, a)) for c, a in zip(completions, answer)]


# ----------------------------------------------------------------------------------------------- the trainer
def config(args):
    from trl_ppo import PPOConfig

    critic = args.estimator == "gae"
    mini_batches = args.num_mini_batches or 1
    capped = {} if args.tis_cap is None else {"tis_cap": args.tis_cap}
    if args.generation_backend is not None:
        capped["generation_backend"] = args.generation_backend
    return PPOConfig(
        # The update in passes of `--micro_batch` episodes: the same update (the loss is normalised over the whole
        # batch), a quarter of the activations of one pass of 8 (7.5 of the demo's 10 GB were those).
        output_dir=args.output_dir, per_device_train_batch_size=args.micro_batch,
        # The batch is per_device x accumulation (trl_ppo's `batch_size`), which `num_mini_batches` then splits.
        gradient_accumulation_steps=args.batch_size // args.micro_batch,
        total_episodes=args.batch_size * args.updates, num_ppo_epochs=args.ppo_epochs,
        num_mini_batches=mini_batches,
        learning_rate=args.learning_rate, lr_scheduler_type=args.lr_scheduler_type, temperature=1.0,
        response_length=args.response_length, max_turns=args.max_turns, max_tool_response_length=8,
        stop_token="eos", missing_eos_penalty=args.missing_eos_penalty,
        tool_chat_template="chatml", advantage_estimator=args.estimator,
        gae_level="turn", lam=1.0,  # the final answer's reward reaches the first call undecayed (RESULTS, credit)
        num_generations=1 if critic else args.num_generations, kl_coef=args.kl_coef, max_grad_norm=args.max_grad_norm,
        skip_zero_gradient_steps=args.skip_zero_gradient_steps,
        local_rollout_forward_batch_size=args.batch_size, num_sample_generations=0, seed=args.seed,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500, save_total_limit=1,
        report_to="none", logging_steps=1, use_cpu=args.device == "cpu", bf16=args.device == "cuda", disable_tqdm=True,
        max_staleness=args.max_staleness, off_policy_correction=args.off_policy_correction,
        critic_learning_rate=args.critic_learning_rate, agent_rollout=args.agent_rollout, **capped,
    )


def trainer_for(args, policy, tokenizer):
    from datasets import Dataset

    from trl_ppo import PPOTrainer

    rows = task.split_problems()[1]  # never a held-out problem
    dataset = Dataset.from_dict({"prompt": [task.prompt_messages(*p) for p in rows],
                                 "answer": [task.answer(*p) for p in rows]})
    return PPOTrainer(args=config(args), processing_class=tokenizer, model=policy, ref_model=None, value_model=None,
                      reward_model=[answer_reward], train_dataset=dataset, tools=list(task.TOOLS))


def load_policy(folder: str):
    """The warm start as the policy. With 'gae' the trainer adds the critic, a value head on the policy's backbone,
    starting at zero (`value_head_init`). A head drawn at random (the `AutoModelForCausalLMWithValueHead` of an
    earlier version of this script) started 1.75 off in RMS against scores in [0, 1], more noise than signal; that
    pilot did not learn in 96 episodes (it also had a linear schedule: the two causes were not separated)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder)


# ------------------------------------------------------------------------------------------------ evaluation
def evaluate(model, tokenizer, problems, args, tools: bool = True) -> dict:
    """Greedy episodes on `problems`, with training's turns and token budget -> success, tool-call rate, tool calls
    and tool errors per episode. `tools=False`: the floor, one turn with the tokenizer's own template, no tools."""
    model = model.to(args.device)  # float32 on either device, as the CPU's figures
    if tools:
        result = task.evaluate(model, tokenizer, problems, args.max_turns, args.response_length,
                               batch_size=args.eval_batch, score=is_correct)
    else:
        result = task.evaluate_without_tools(model, tokenizer, problems, args.response_length, args.eval_batch,
                                             is_correct)
    episodes = result["episodes"]
    result["calls_per_episode"] = sum(e.count("<tool_call>") for e in episodes) / len(episodes)
    result["tool_errors_per_episode"] = sum(e.count("<tool_response>\nError:") for e in episodes) / len(episodes)
    return result


def warm_start_evaluation(args, tokenizer, held_out) -> dict:
    """The warm start's greedy evaluation, kept in its folder after the first time (it is deterministic); the
    episodes are not kept, only their numbers and the first one."""
    import json

    path = os.path.join(args.warm_start, f"evaluation_{len(held_out)}_{args.max_turns}_{args.response_length}.json")
    if os.path.exists(path):
        with open(path) as file:
            return json.load(file)
    from transformers import AutoModelForCausalLM

    result = evaluate(AutoModelForCausalLM.from_pretrained(args.warm_start), tokenizer, held_out, args)
    result = {name: value for name, value in result.items() if name != "episodes"}
    with open(path, "w") as file:
        json.dump(result, file)
    return result


def clock() -> tuple[float, float]:
    """(CPU seconds of this process, wall seconds) now: a stage's cost is `took(clock())` at its end."""
    return time.process_time(), time.perf_counter()


def took(start: tuple[float, float]) -> str:
    cpu, wall = (now - then for now, then in zip(clock(), start))
    return f"{cpu:.0f} CPU s, {wall / 60:.1f} min"


def report(when: str, result: dict, cost: str) -> None:
    print(f"{when}: held-out success {result['success']:.2f}, episodes calling a tool {result['tool_call_rate']:.2f},"
          f" tool calls per episode {result['calls_per_episode']:.2f}, tool errors per episode "
          f"{result['tool_errors_per_episode']:.2f} ({cost})", flush=True)
    print("  first episode: " + result["sample"].replace("\n", "\n  "), flush=True)


def build_parser(description: str = __doc__, estimators=ESTIMATORS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=task.DEFAULT_MODEL, help="SmolLM2 folder (get_smollm2.py)")
    parser.add_argument("--warm_start", default=task.DEFAULT_OUTPUT, help="cached warm start (made when missing)")
    parser.add_argument("--output_dir", default=os.path.join(task.ROOT, "runs", "smollm2_tool_agent"))
    parser.add_argument("--estimator", choices=estimators, default="gae")
    parser.add_argument("--updates", type=int, default=12, help="training updates (0: evaluate only)")
    parser.add_argument("--batch_size", type=int, default=8, help="episodes per update")
    parser.add_argument("--micro_batch", type=int, default=2,
                        help="episodes per forward/backward pass of the update (divides --batch_size): less memory, "
                        "the same update")
    parser.add_argument("--num_generations", type=int, default=4, help="group size of the critic-free estimators")
    parser.add_argument("--ppo_epochs", type=int, default=1)
    parser.add_argument("--num_mini_batches", type=int, default=None,
                        help="optimizer steps per PPO epoch, each on batch/M episodes (default 1: one step per "
                        "update, where PPO's ratio stays 1 and its clip never acts)")
    parser.add_argument("--learning_rate", type=float, default=3e-5)
    parser.add_argument("--lr_scheduler_type", choices=("constant", "linear"), default="constant")
    parser.add_argument("--kl_coef", type=float, default=0.05)
    parser.add_argument("--max_grad_norm", type=float, default=0.0,
                        help="clip the gradient's norm to this before each optimizer step (0: no clipping, "
                        "trl_ppo's default as PPOv2's)")
    parser.add_argument("--skip_zero_gradient_steps", action="store_true",
                        help="take no optimizer step on a gradient of exactly zero (every group flat), where AdamW "
                        "would still move the weights by its momentum")
    parser.add_argument("--missing_eos_penalty", type=float, default=None,
                        help="subtracted from the score of an episode cut by the token budget (default: none, the "
                        "reward is the final answer's alone)")
    parser.add_argument("--response_length", type=int, default=160,
                        help="tokens of a whole episode after the prompt, tool answers included")
    parser.add_argument("--max_turns", type=int, default=4)
    parser.add_argument("--held_out", type=int, default=100, help="held-out problems evaluated before and after")
    parser.add_argument("--eval_batch", type=int, default=25)
    parser.add_argument("--save_steps", type=int, default=0, help="checkpoint every N updates (0: none)")
    parser.add_argument("--resume", action="store_true", help="go on from the last checkpoint in --output_dir")
    parser.add_argument("--max_staleness", type=int, default=0,
                        help="asynchronous PPO: sample up to this many updates ahead in a process of its own (0: off)")
    parser.add_argument("--off_policy_correction", choices=("decoupled", "tis", "mis", "none"), default=None,
                        help="with --max_staleness: how the update corrects for the older sampling policy")
    parser.add_argument("--tis_cap", type=float, default=None,
                        help="C of 'tis' and 'mis' (default: the trainer's, 2.0)")
    parser.add_argument("--critic_learning_rate", type=float, default=None,
                        help="with 'gae': the value head's own rate (default: --learning_rate, as the policy's)")
    parser.add_argument("--agent_rollout", choices=("continuous", "lockstep"), default="continuous",
                        help="how the episodes are played: the episode engine, or every turn in lockstep (the loop "
                        "before it, kept for comparison)")
    parser.add_argument("--generation_backend", choices=("kv_cache", "vllm"), default=None,
                        help="what samples the training episodes (default: the trainer's, the episode engine on the "
                        "policy); 'vllm' needs vLLM (pip install 'trl_ppo[vllm]')")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where to train and evaluate: 'cuda' trains in bf16 (the warm start is made on the CPU)")
    parser.add_argument("--floor", action="store_true",
                        help="first evaluate the model of --model without tools (one turn, its own chat template)")
    return parser


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def parse_args(argv=None, parser: argparse.ArgumentParser | None = None):
    """The arguments, checked before any model is loaded."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    for name in ("batch_size", "micro_batch", "num_generations", "ppo_epochs", "response_length", "max_turns",
                 "held_out", "eval_batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.updates < 0 or args.save_steps < 0:
        parser.error("--updates and --save_steps must be at least 0")
    if args.max_grad_norm is not None and args.max_grad_norm < 0:
        parser.error(f"--max_grad_norm must be at least 0 (0: no clipping), got {args.max_grad_norm}")
    if args.batch_size % args.micro_batch:
        parser.error(f"--micro_batch ({args.micro_batch}) must divide --batch_size ({args.batch_size})")
    if args.num_mini_batches is not None and (
        args.num_mini_batches < 1 or args.batch_size % (args.micro_batch * args.num_mini_batches)
    ):
        parser.error(f"--micro_batch x --num_mini_batches ({args.micro_batch} x {args.num_mini_batches}) must "
                     f"divide --batch_size ({args.batch_size})")
    if args.tis_cap is not None and not args.tis_cap >= 1:
        parser.error(f"--tis_cap must be at least 1, got {args.tis_cap}")
    if args.critic_learning_rate is not None and (args.estimator != "gae" or not args.critic_learning_rate > 0):
        parser.error(f"--critic_learning_rate must be > 0, and needs --estimator gae (a critic), got "
                     f"{args.critic_learning_rate} with {args.estimator}")
    if args.estimator != "gae" and args.batch_size % args.num_generations:
        parser.error(f"--batch_size ({args.batch_size}) must be a multiple of --num_generations "
                     f"({args.num_generations})")
    if args.device == "cuda" and not cuda_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        parser.error(f"--model {args.model} is not a model folder: run examples/scripts/get_smollm2.py first")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    held_out, floor = task.split_problems()[0][: args.held_out], {}
    if args.floor:
        from transformers import AutoModelForCausalLM

        start = clock()
        floor = {"floor": evaluate(AutoModelForCausalLM.from_pretrained(args.model), tokenizer, held_out, args, False)}
        report("the model without tools (the floor)", floor["floor"], took(start))
    start = clock()
    task.cached_warm_start(args.model, tokenizer, args.warm_start, args.device)
    print(f"[warm start: {took(start)}]", flush=True)
    start = clock()
    before = warm_start_evaluation(args, tokenizer, held_out)
    report("warm start", before, took(start))
    if args.updates == 0:
        return {**floor, "before": before}
    policy = load_policy(args.warm_start)
    start = clock()
    trainer_for(args, policy, tokenizer).train(resume_from_checkpoint=True if args.resume else None)
    training = time.process_time() - start[0]
    print(f"[{args.estimator}: {args.updates} updates of {args.batch_size} episodes, {took(start)}]", flush=True)
    start = clock()
    after = evaluate(policy, tokenizer, held_out, args)  # trained in place (under the trainer's value head)
    report(f"after {args.estimator}", after, took(start))
    print(f"Held-out success {before['success']:.2f} -> {after['success']:.2f}", flush=True)
    return {**floor, "before": before, "after": after, "train_cpu_seconds": training}


if __name__ == "__main__":
    main()

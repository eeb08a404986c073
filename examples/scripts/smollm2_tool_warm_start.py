"""A warm start that teaches SmolLM2-135M-Instruct the tool-call format, not the answers (issue 43, part 2).

The task (part 3): "What is (a * b) + c?" with numbers a 135M model cannot work out in its head, and two tools that
each do one operation (`multiply`, `add`), so it needs the tool twice. The warm start's transcripts are two-call
demonstrations "(a op b) op c" of the four pairs of operations, on training problems only (never a held-out one):
call, read the answer, call again on it, then "The answer is N." copied from the second answer. A quarter of them
have the task's shape; 10 steps of 8 are too few for the model to learn which operator goes where, so it starts
from zero held-out success and RL has the whole way to go.

The transcripts are rendered with the ChatML tool template shipped with trl_ppo (`tool_chat_template="chatml"`,
what the trainer then uses) and trained on the model's own turns only (`agent_task.sft_example`) with transformers'
`Trainer`. The result is cached in `.cache/smollm2-tool-warm-start` (a second run returns it).

Measured (seed 0, greedy on the 100 held-out problems, one thread of a shared 2-core machine, 2026-11-27; RESULTS,
"A real chat model learns a tool"): the default, 10 steps at lr 2e-4, took 422 CPU-seconds; the model calls a tool
in 100 of 100 episodes, twice each, and solves none (it multiplies twice). Sampled at temperature 1 it writes the
task's shape sometimes, which is RL's signal. Warm starts that showed fewer chains solved none even when sampled:
one-call transcripts only (0 of 100 sampled), or half two-call ones (0 of 25).

    python examples/scripts/get_smollm2.py .cache/smollm2-135m-instruct
    python examples/scripts/smollm2_tool_warm_start.py --model .cache/smollm2-135m-instruct --evaluate 100
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmark", "agents"))  # agent_task: SFT examples masked to the model's turns
import agent_task  # noqa: E402

DEFAULT_MODEL = os.path.join(ROOT, ".cache", "smollm2-135m-instruct")
DEFAULT_OUTPUT = os.path.join(ROOT, ".cache", "smollm2-tool-warm-start")
DONE_MARKER = "warm_start_done.txt"  # written last: a folder without it is an interrupted run
NUM_HELD_OUT = 100


# --------------------------------------------------------------------------------------------------- tools
def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first term.
        b: the second term.
    """
    return a + b


TOOLS = (multiply, add)


# ------------------------------------------------------------------------------------------------ problems
def split_problems(num_held_out: int = NUM_HELD_OUT, count: int = 2000, seed: int = 43):
    """(held-out, training) lists of (a, b, c) for "(a * b) + c": a, b in [13, 99], c in [100, 999], no triple in
    both (the held-out ones are never seen by the warm start or RL)."""
    rng = random.Random(seed)
    problems = list(dict.fromkeys((rng.randint(13, 99), rng.randint(13, 99), rng.randint(100, 999))
                                  for _ in range(count)))
    return problems[:num_held_out], problems[num_held_out:]


HELD_OUT = frozenset(split_problems()[0])


def question(a: int, b: int, c: int) -> str:
    return f"What is ({a} * {b}) + {c}?"


def prompt_messages(a: int, b: int, c: int) -> list[dict]:
    return [{"role": "user", "content": question(a, b, c)}]


def answer(a: int, b: int, c: int) -> int:
    return a * b + c


# ----------------------------------------------------------------------------------------- the transcripts
def one_operation_conversation(rng: random.Random) -> list[dict]:
    """A one-call demonstration: a product of two 2-digit numbers, or a sum of a 4-digit and a 3-digit one (the
    sizes the two steps of the task see), called, answered, and the answer copied from the tool."""
    tool = rng.choice(TOOLS)
    a, b = (rng.randint(13, 99), rng.randint(13, 99)) if tool is multiply else (rng.randint(169, 9801),
                                                                                rng.randint(100, 999))
    sign = "*" if tool is multiply else "+"
    call = {"type": "function", "function": {"name": tool.__name__, "arguments": {"a": a, "b": b}}}
    return [
        {"role": "user", "content": f"What is {a} {sign} {b}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": tool.__name__, "content": str(tool(a, b))},
        {"role": "assistant", "content": f"The answer is {tool(a, b)}."},
    ]


# The two-call shapes: every pair of (first, second) operations; OTHER_SHAPES leaves out the task's own.
CHAIN_SHAPES = ((multiply, add), (add, multiply), (multiply, multiply), (add, add))
OTHER_SHAPES = CHAIN_SHAPES[1:]


def two_operation_conversation(rng: random.Random, shapes=CHAIN_SHAPES) -> list[dict]:
    """A two-call demonstration "(a op b) op c" of one of `shapes`, each step one call, the second on the first's
    answer, on numbers drawn like the task's (a training problem when the shape is the task's)."""
    first, second = rng.choice(shapes)
    a, b = rng.randint(13, 99), rng.randint(13, 99)
    c = rng.randint(100, 999) if second is add else rng.randint(13, 99)
    while (first, second) == CHAIN_SHAPES[0] and (a, b, c) in HELD_OUT:  # never a held-out problem
        c = rng.randint(100, 999)
    signs = {multiply: "*", add: "+"}
    messages = [{"role": "user", "content": f"What is ({a} {signs[first]} {b}) {signs[second]} {c}?"}]
    for tool, x, y in ((first, a, b), (second, first(a, b), c)):
        call = {"type": "function", "function": {"name": tool.__name__, "arguments": {"a": x, "b": y}}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "name": tool.__name__, "content": str(tool(x, y))}]
    return messages + [{"role": "assistant", "content": f"The answer is {second(first(a, b), c)}."}]


def rendering_tokenizer(tokenizer):
    """A copy of `tokenizer` with the shipped ChatML tool template and its parser (the caller's is left as it is):
    transcripts and evaluation episodes render as the trainer's with `tool_chat_template="chatml"`."""
    from trl_ppo.agents.templates import shipped_templates

    rendering = copy.copy(tokenizer)
    rendering.chat_template, rendering.response_template = shipped_templates("chatml", tokenizer)
    return rendering


def warm_start_examples(tokenizer, count: int, seed: int = 0, chain_rate: float = 1.0, shapes=CHAIN_SHAPES):
    """`count` (ids, labels) pairs of transcripts, labels on the model's turns only: a fraction `chain_rate` of
    two-call ones of `shapes` (`two_operation_conversation`), the rest one-call ones."""
    rng, rendering = random.Random(seed), rendering_tokenizer(tokenizer)

    def conversation():
        return two_operation_conversation(rng, shapes) if rng.random() < chain_rate else one_operation_conversation(rng)

    return [agent_task.sft_example(rendering, conversation(), TOOLS) for _ in range(count)]


# ------------------------------------------------------------------------------------------------ evaluation
def evaluate(model, tokenizer, problems, max_turns: int = 4, budget: int = 160, temperature: float | None = None,
             batch_size: int = 25, score=None) -> dict:
    """Episodes on "(a * b) + c" `problems` with both tools, greedy (`temperature` None) -> `agent_task`'s
    {"success", "tool_call_rate", "success_when_calling", "sample", "episodes"}."""
    rendering = rendering_tokenizer(tokenizer)
    prompts = [rendering.encode(rendering.apply_chat_template(prompt_messages(*p), tools=list(TOOLS), tokenize=False,
                                                              add_generation_prompt=True), add_special_tokens=False)
               for p in problems]
    return agent_task.evaluate_prompts(model, rendering, prompts, [answer(*p) for p in problems], list(TOOLS),
                                       max_turns, budget, temperature, batch_size=batch_size, score=score)


def evaluate_without_tools(model, tokenizer, problems, budget: int = 160, batch_size: int = 25, score=None) -> dict:
    """The floor: one greedy turn per problem, rendered with the tokenizer's own chat template and no tools, `budget`
    tokens -> as `evaluate`."""
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(prompt_messages(*p), tokenize=False,
                                                              add_generation_prompt=True), add_special_tokens=False)
               for p in problems]
    return agent_task.evaluate_prompts(model, tokenizer, prompts, [answer(*p) for p in problems], None, 1, budget,
                                       batch_size=batch_size, score=score)


# -------------------------------------------------------------------------------------------- the warm start
def is_done(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, DONE_MARKER))


def warm_start(model, tokenizer, output_dir: str, steps: int, batch_size: int = 8, learning_rate: float = 2e-4,
               seed: int = 0, chain_rate: float = 1.0, shapes=CHAIN_SHAPES, device: str = "cpu") -> str:
    """Fine-tune `model` for `steps` steps on one-operation transcripts with transformers' `Trainer` (float32 on
    `device`), and save it with `tokenizer` (its own chat template) to `output_dir`; a folder already done is
    returned as it is."""
    if is_done(output_dir):
        return output_dir
    from transformers import Trainer, TrainingArguments

    examples = warm_start_examples(tokenizer, steps * batch_size, seed, chain_rate, shapes)
    args = TrainingArguments(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=batch_size,
                             learning_rate=learning_rate, lr_scheduler_type="constant", logging_steps=10,
                             save_strategy="no", report_to="none", seed=seed, use_cpu=device == "cpu",
                             remove_unused_columns=False)
    trainer = Trainer(model=model, args=args, train_dataset=examples,
                      data_collator=lambda rows: agent_task.sft_batch(tokenizer, rows))
    trainer.train()
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    with open(os.path.join(output_dir, DONE_MARKER), "w") as marker:
        marker.write(f"steps={steps} batch_size={batch_size} learning_rate={learning_rate} seed={seed} "
                     f"chain_rate={chain_rate} shapes={'all' if shapes == CHAIN_SHAPES else 'others'}\n")
    return output_dir


def cached_warm_start(model_folder: str, tokenizer, output_dir: str = DEFAULT_OUTPUT, device: str = "cpu") -> str:
    """The warm start in `output_dir`, made from `model_folder` with the defaults when it is not there yet ->
    its settings (the marker's line: they name the warm start in benchmark rows)."""
    if not is_done(output_dir):
        from transformers import AutoModelForCausalLM

        print(f"Warm start (cached in {output_dir} for the next run)...", flush=True)
        warm_start(AutoModelForCausalLM.from_pretrained(model_folder), tokenizer, output_dir, steps=10, device=device)
    with open(os.path.join(output_dir, DONE_MARKER)) as marker:
        return marker.read().strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="SmolLM2 folder (get_smollm2.py)")
    parser.add_argument("--output_dir", default=DEFAULT_OUTPUT)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=2e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chain_rate", type=float, default=1.0, help="fraction of two-call transcripts")
    parser.add_argument("--other_shapes", action="store_true", help="two-call transcripts never of the task's shape")
    parser.add_argument("--evaluate", type=int, default=0, help="held-out problems to play greedily before and after")
    parser.add_argument("--temperature", type=float, default=None, help="also evaluate sampled at this temperature")
    parser.add_argument("--skip_before", action="store_true", help="evaluate the warm start only")
    args = parser.parse_args(argv)
    import time

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(args.model)
    held_out = split_problems()[0][: args.evaluate]
    if held_out and not args.skip_before:
        report("before", evaluate(model, tokenizer, held_out))
    start = time.process_time()
    folder = warm_start(model, tokenizer, args.output_dir, args.steps, args.batch_size, args.learning_rate, args.seed,
                        args.chain_rate, OTHER_SHAPES if args.other_shapes else CHAIN_SHAPES)
    print(f"Warm start in {folder} ({time.process_time() - start:.0f} CPU s in this process)")
    if held_out:
        start = time.process_time()
        warm = AutoModelForCausalLM.from_pretrained(folder)
        report("after", evaluate(warm, tokenizer, held_out))
        if args.temperature is not None:
            report(f"after, sampled at {args.temperature}", evaluate(warm, tokenizer, held_out,
                                                                     temperature=args.temperature))
        print(f"[evaluation: {time.process_time() - start:.0f} CPU s]")


def report(when: str, result: dict) -> None:
    print(f"{when}: held-out success {result['success']:.2f}, tool-call rate {result['tool_call_rate']:.2f}, "
          f"success when calling {result['success_when_calling']}")
    print(f"  first episode: {result['sample']!r}")


if __name__ == "__main__":
    main()

"""The task of `benchmark/agents/agent_tools.py`: "What is A * B?" for two-digit A and B, with a `multiply` tool.

* `multiply`: the tool (type hints and a docstring, as `tools=` takes it); `split_problems`: a fixed held-out
  set and the pool SFT and RL draw from; `question` / `prompt_messages`: the user message.
* `final_answer` / `product_reward`: the verifiable rule. The final answer is the text of the model's last turn
  (after its last `</tool_call>` for trl_ppo's decoded completion; the last assistant message's content for TRL's
  list of messages); reward 1.0 when the last integer in it is exactly A * B, else 0.0. A tool call's JSON
  arguments are never scored (they are not in the final answer).
* `build_tokenizer`: `trl_ppo.agents.tiny_chat.build_tool_tokenizer()` whose system block names the tools and their
  arguments only (`TOOLS_BLOCK`) instead of their whole JSON schemas; the tool-call markup is `tiny_chat`'s.
* `sft_conversation` / `sft_example` / `train_sft`: a tiny Qwen2 trained from scratch on conversations rendered
  with that chat template and `tools=[multiply]` (the prompt the trainers render), loss on the assistant's
  tokens only (each turn up to and including its `<|im_end|>`). A fraction `tool_rate` of them call the tool with
  the right arguments and copy its answer into "The answer is N."; the rest answer at once with a guess of the
  right size (A * B times a factor in [0.85, 1.15]). Copying the digits is what a tiny model learns slowly (a
  64-wide one answered no call right after 600 steps of plain SFT with tiny_chat's full schemas in the prompt,
  nor after 700 steps weighted as here with the short block), so the model is 128 wide with 8 heads, RoPE's
  base is 100, the copied digits' loss is weighted 10x, and SFT first trains on demonstrations that all call
  the tool, then on the mix.
* `evaluate`: greedy or sampled episodes on held-out problems through trl_ppo's own turn loop (`agents.turn_loop`),
  with the tool answered (`tools=True`, up to `max_turns` turns) or not (one turn: a tool call then goes
  unanswered); `evaluate_prompts` does it for any prompts, answers and tools (examples/scripts/agent_calculator.py).
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import asdict, dataclass

import torch

LOW, HIGH = 10, 99  # both factors two-digit: 8,100 problems, products of 3-4 digits
QUESTION = re.compile(r"What is (\d+) \* (\d+)\?")


# The tools' system block of `tiny_chat.CHAT_TEMPLATE` shows each tool's whole JSON schema (~320 tokens, byte-level).
# Here it names each tool and its arguments only, so that the copies a tiny model must learn (the question's
# numbers into the call, the tool's answer into the reply) span tens of tokens, not hundreds; the tool-call and
# tool-answer markup, and the `response_template` that parses it, are `tiny_chat`'s.
TOOLS_BLOCK = (
    "{% if tools %}<|im_start|>system{{ '\\n' }}Tools:{% for tool in tools %} {{ tool.function.name }}"
    "({{ tool.function.parameters.properties | join(', ') }}){% endfor %}<|im_end|>{{ '\\n' }}{% endif %}"
)


def build_tokenizer():
    """`tiny_chat.build_tool_tokenizer()` with the short tools' system block (`TOOLS_BLOCK`)."""
    from trl_ppo.agents.tiny_chat import CHAT_TEMPLATE, build_tool_tokenizer

    tokenizer = build_tool_tokenizer()
    tokenizer.chat_template = TOOLS_BLOCK + CHAT_TEMPLATE[CHAT_TEMPLATE.index("{% for message in messages %}") :]
    return tokenizer


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


# ----------------------------------------------------------------------------------------------- problems
def split_problems(num_eval: int = 200, seed: int = 1234) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(held-out problems, pool): every (a, b) once, shuffled with a fixed seed; the first `num_eval` are never
    seen by SFT or RL."""
    problems = [(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]
    random.Random(seed).shuffle(problems)
    return problems[:num_eval], problems[num_eval:]


def question(a: int, b: int) -> str:
    return f"What is {a} * {b}?"


def prompt_messages(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": question(a, b)}]


def prompt_ids(tokenizer, a: int, b: int) -> list[int]:
    """The prompt as the trainers render it: the tools' system block, the question, the assistant header."""
    text = tokenizer.apply_chat_template(
        prompt_messages(a, b), tools=[multiply], tokenize=False, add_generation_prompt=True
    )
    return tokenizer.encode(text, add_special_tokens=False)


# ------------------------------------------------------------------------------------------------- reward
def final_answer(completion) -> str:
    """The text of the model's last turn: after the last `</tool_call>` of a decoded completion (str), or the
    content of the last assistant message of a list of messages (TRL's conversational completions)."""
    if isinstance(completion, str):
        return completion.rsplit("</tool_call>", 1)[-1]
    assistant = [m for m in completion if m.get("role") == "assistant"]
    return (assistant[-1].get("content") or "") if assistant else ""


def is_correct(completion, product: int) -> bool:
    numbers = re.findall(r"\d+", final_answer(completion))
    return bool(numbers) and int(numbers[-1]) == int(product)


def calls_tool(completion) -> bool:
    """Whether the model wrote a tool call (parsed or not) anywhere in the episode."""
    if isinstance(completion, str):
        return "<tool_call>" in completion
    return any(m.get("tool_calls") for m in completion if m.get("role") == "assistant")


def product_reward(prompts, completions, product, **columns) -> list[float]:
    """1.0 when the last integer of the final answer is the product, else 0.0 (trl_ppo and TRL reward function)."""
    return [float(is_correct(c, p)) for c, p in zip(completions, product)]


# ---------------------------------------------------------------------------------------------------- SFT
@dataclass(frozen=True)
class SFTSettings:
    """Two stages: `copy_steps` on demonstrations that all call the tool (the copies; a one-cycle schedule peaking
    at `learning_rate`), then `steps` on demonstrations of which a fraction `tool_rate` call it (the start's
    calling rate), at the constant `late_learning_rate`."""

    hidden_size: int = 128  # 64 wide (4 heads) had not learnt the copies after 700 steps; 128 (8 heads) in 150
    num_layers: int = 2
    num_heads: int = 8
    rope_theta: float = 100.0  # RoPE frequencies spread over the 10-70 token offsets the copies span
    copy_steps: int = 300
    steps: int = 150
    tool_rate: float = 0.3
    digit_weight: float = 10.0  # the loss of copied digits weighs this much more
    batch_size: int = 16
    learning_rate: float = 2e-3  # a 5e-3 peak did not learn the copies in 300 steps
    late_learning_rate: float = 1e-3
    seed: int = 0

    def key(self) -> str:
        return "agent-sft-" + "-".join(f"{k}{v}" for k, v in asdict(self).items())


def sft_conversation(a: int, b: int, rng: random.Random, tool_rate: float) -> list[dict]:
    """A demonstration: with probability `tool_rate` the tool is called and its answer copied, else a guess."""
    if rng.random() < tool_rate:
        call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
        return prompt_messages(a, b) + [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "multiply", "content": str(multiply(a, b))},
            {"role": "assistant", "content": f"The answer is {a * b}."},
        ]
    guess = max(1, round(a * b * rng.uniform(0.85, 1.15)))
    return prompt_messages(a, b) + [{"role": "assistant", "content": f"The answer is {guess}."}]


def sft_example(tokenizer, messages: list[dict], tools: tuple = (multiply,)) -> tuple[list[int], list[int]]:
    """(ids, labels) of a conversation rendered with `tools`: labels are the ids of each assistant turn up to and
    including its stop token, -100 elsewhere. The pieces are encoded one by one (each turn as the model would
    write it, after its header), which for a byte-level tokenizer is the encoding of the whole."""

    def render(upto: int, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            messages[:upto], tools=list(tools), tokenize=False, add_generation_prompt=generation_prompt
        )

    ids, labels, done = [], [], ""
    stop = tokenizer.eos_token
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        header = render(index, True)
        turn = render(index + 1, False)[len(header) :]
        turn = turn[: turn.index(stop) + len(stop)]
        context = tokenizer.encode(header[len(done) :], add_special_tokens=False)
        answer = tokenizer.encode(turn, add_special_tokens=False)
        ids += context + answer
        labels += [-100] * len(context) + answer
        done = header + turn
    return ids, labels


def sft_batch(tokenizer, examples: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    """Right-padded rows (the model trains on whole rows from position 0)."""
    width = max(len(ids) for ids, _ in examples)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in examples])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in examples])
    attention_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in examples])
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def build_policy(tokenizer, settings: SFTSettings):
    from learning_task import tiny_causal_lm  # benchmark/learning/ is on the path of the scripts that train

    return tiny_causal_lm(
        "qwen2", tokenizer, settings, num_key_value_heads=settings.num_heads, max_position_embeddings=1024,
        rope_theta=settings.rope_theta, tie_word_embeddings=True,
    )


def sft_loss(model, batch: dict[str, torch.Tensor], copies: torch.Tensor, digit_ids, digit_weight: float):
    """Next-token cross-entropy on the labelled tokens; the digits of rows that copy (`copies` [B], bool: those
    calling the tool) weighted `digit_weight` (a guess's digits are noise: weighted 1)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    copied = torch.isin(labels, digit_ids) & copies.unsqueeze(1)
    weights = torch.where(copied, digit_weight, 1.0) * (labels != -100)
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels.clamp(min=0), reduction="none")
    return (losses * weights).sum() / weights.sum()


def train_sft(tokenizer, pool: list[tuple[int, int]], settings: SFTSettings, output_dir: str, log=print) -> str:
    """Train (or reuse) the SFT policy (the stages of `SFTSettings`); -> the folder it is saved in
    (`<output_dir>/<settings key>`)."""
    path = os.path.join(output_dir, settings.key())
    if os.path.exists(os.path.join(path, "done.json")):
        return path
    model = build_policy(tokenizer, settings)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, weight_decay=0.01)
    sampler = random.Random(settings.seed)
    one_cycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, settings.learning_rate, total_steps=settings.copy_steps)
    model.train()
    for name, steps, rate, schedule in [
        ("copy", settings.copy_steps, 1.0, one_cycle),
        ("mixed", settings.steps, settings.tool_rate, None),
    ]:
        if schedule is None:
            for group in optimizer.param_groups:
                group["lr"] = settings.late_learning_rate
        for step in range(steps):
            problems = sampler.sample(pool, settings.batch_size)
            loss = sft_step(model, optimizer, tokenizer, problems, sampler, rate, settings.digit_weight)
            if schedule is not None:
                schedule.step()
            if (step + 1) % max(1, steps // 4) == 0:
                log(f"SFT {name} step {step + 1}/{steps}: loss {loss:.4f}")
    from learning_task import save_sft  # benchmark/learning/ is on the path of the scripts that train

    return save_sft(model, tokenizer, settings, path)


def sft_step(model, optimizer, tokenizer, problems, sampler, tool_rate: float, digit_weight: float) -> float:
    """One optimizer step on demonstrations of `problems`; -> the loss."""
    rows = [sft_conversation(a, b, sampler, tool_rate) for a, b in problems]
    batch = sft_batch(tokenizer, [sft_example(tokenizer, row) for row in rows])
    copies = torch.tensor([len(row) > 2 for row in rows])
    digit_ids = torch.tensor(tokenizer.convert_tokens_to_ids(list("0123456789")))
    loss = sft_loss(model, batch, copies, digit_ids, digit_weight)
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.item()


def one_cycle_sft(model, tokenizer, settings, make_examples, log=print, name: str = "SFT") -> None:
    """`learning_task.one_cycle_steps` on the (ids, labels) examples `make_examples()` returns: next-token loss on
    the labelled tokens, equally weighted."""
    from learning_task import one_cycle_steps  # benchmark/learning/ is on the path of the scripts that train

    no_copies = torch.zeros(settings.batch_size, dtype=torch.bool)
    digits = torch.tensor(tokenizer.convert_tokens_to_ids(list("0123456789")))  # weight 1: no token counts more
    one_cycle_steps(model, settings, lambda: sft_loss(model, sft_batch(tokenizer, make_examples()), no_copies,
                                                      digits, 1.0), log, name, logs=4)


# ---------------------------------------------------------------------------------------------- evaluation
def model_sampler(model, tokenizer, temperature: float | None, batch_size: int = 50):
    """A `turn_loop.TurnSampler` with `model.generate`: greedy (`temperature` None) or sampled at `temperature`
    (no top-k / top-p), each turn cut after its stop token."""
    from trl_ppo.data import LeftPaddingCollator

    collate, stop = LeftPaddingCollator(tokenizer.pad_token_id), tokenizer.eos_token_id
    sampling = dict(do_sample=False) if temperature is None else dict(
        do_sample=True, temperature=temperature, top_k=0, top_p=1.0)

    def sample_turn(contexts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        turns = []
        for start in range(0, len(contexts), batch_size):
            batch = collate([{"input_ids": c} for c in contexts[start : start + batch_size]])
            batch = {name: tensor.to(model.device) for name, tensor in batch.items()}
            output = model.generate(
                **batch, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, eos_token_id=stop,
                **sampling,
            )
            for row in output[:, batch["input_ids"].size(1) :].tolist():
                turns.append(row[: row.index(stop) + 1] if stop in row else row)
        return turns

    return sample_turn


def evaluate(
    model, tokenizer, problems, tools: bool, max_turns: int, budget: int, temperature: float | None = None, seed=0
) -> dict:
    """Episodes on `problems`, greedy (`temperature` None) or sampled with `seed` -> {"success", "tool_call_rate",
    "success_when_calling", "sample" (the first episode after its prompt)}."""
    prompts = [prompt_ids(tokenizer, a, b) for a, b in problems]
    result = evaluate_prompts(model, tokenizer, prompts, [a * b for a, b in problems], [multiply] if tools else None,
                              max_turns, budget, temperature, seed)
    del result["episodes"]  # the benchmark's rows keep the first one only
    return result


@torch.no_grad()
def evaluate_prompts(model, tokenizer, prompts: list[list[int]], answers: list[int], tool_functions: list | None,
                     max_turns: int, budget: int, temperature: float | None = None, seed=0, batch_size: int = 50,
                     score=None) -> dict:
    """Episodes from `prompts` (ids) with `tool_functions` answered (None: one turn, calls unanswered), greedy
    (`temperature` None) or sampled with `seed` -> {"success", "tool_call_rate", "success_when_calling", "sample"
    (the first episode after its prompt), "episodes" (each episode after its prompt)}. `score(completion, answer)`
    -> bool judges an episode's model text (default `is_correct`)."""
    from trl_ppo.agents.chat import ToolChat
    from trl_ppo.agents.tools import schemas, toolbox
    from trl_ppo.rollout.turn_loop import Episode, run_turns

    was_training = model.training
    model.eval()
    box = toolbox(tool_functions or [])
    chat = ToolChat(tokenizer, schemas(box), tokenizer.eos_token_id) if tool_functions else None
    episodes = [Episode(list(prompt), box) for prompt in prompts]
    torch.manual_seed(seed)
    run_turns(episodes, model_sampler(model, tokenizer, temperature, batch_size), chat,
              max_turns if tool_functions else 1, budget)
    model.train(was_training)
    completions = [tokenizer.decode([t for t, m in zip(e.response, e.model_mask) if m], skip_special_tokens=True)
                   for e in episodes]
    correct = [(score or is_correct)(c, answer) for c, answer in zip(completions, answers)]
    calling = [calls_tool(c) for c in completions]
    called_right = [ok for ok, call in zip(correct, calling) if call]
    return {
        "success": sum(correct) / len(prompts),
        "tool_call_rate": sum(calling) / len(prompts),
        "success_when_calling": sum(called_right) / len(called_right) if called_right else None,
        "sample": tokenizer.decode(episodes[0].response),
        "episodes": [tokenizer.decode(e.response) for e in episodes],
    }

"""The task of `benchmark/learning/learning.py`: two-digit addition ("23+45=" -> "68"), with a verifiable reward.

* `build_char_tokenizer`: one id per character (digits, "+", "="), `[PAD]` / `[EOS]` / `[UNK]`, left padding;
* `split_problems`: a fixed held-out eval set, and the pool the SFT data and the PPO prompts are drawn from;
* `train_sft`: a tiny GPT-NeoX built from config and trained from scratch on "a+b=" -> "c[EOS]" (loss on the
  answer and EOS only), cached in the output directory under a name made of its settings. Its demonstrations
  may forget the carry (`carry_slip`), so that the SFT policy gets most carry problems wrong while it can
  sample the right answer, and a verifier's reward has something to fix;
* `addition_reward`: the rule, 1.0 for a correct answer and 0.0 otherwise, as a trl_ppo reward function;
  `RuleRewardModel`: the same rule as an `nn.Module` with the interface TRL 1.12's `get_reward` reads;
* `greedy_accuracy`: greedy decoding on problems, the fraction answered correctly.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass

import torch
from torch import nn

CHARACTERS = list("0123456789+=")
SPECIAL_TOKENS = {"pad_token": "[PAD]", "eos_token": "[EOS]", "unk_token": "[UNK]"}
MAX_OPERAND = 99  # operands 0..99: 10,000 problems, answers of 1-3 digits


# ---------------------------------------------------------------------------------------------- tokenizer
def build_char_tokenizer():
    """A `PreTrainedTokenizerFast` with one id per character ([PAD] = 0), decoding without separators."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocabulary = {token: index for index, token in enumerate(list(SPECIAL_TOKENS.values()) + CHARACTERS)}
    backend = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token=SPECIAL_TOKENS["unk_token"]))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, padding_side="left", **SPECIAL_TOKENS)


# ----------------------------------------------------------------------------------------------- problems
def prompt_text(a: int, b: int) -> str:
    return f"{a}+{b}="


def split_problems(num_eval: int = 500, seed: int = 1234) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(eval problems, training pool): every (a, b) once, shuffled with a fixed seed; the first `num_eval` are
    held out (never seen by SFT or PPO)."""
    problems = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    random.Random(seed).shuffle(problems)
    return problems[:num_eval], problems[num_eval:]


def answer_text(a: int, b: int) -> str:
    return str(a + b)


def correct_answer(prompt: str) -> str | None:
    """ "23+45=" -> "68"; None when the prompt is not an addition."""
    left, plus, right = prompt.strip().rstrip("=").partition("+")
    if not plus or not left.isdigit() or not right.isdigit():
        return None
    return answer_text(int(left), int(right))


def is_correct(prompt: str, completion: str) -> bool:
    """The verifiable rule: the completion (special tokens already dropped) is exactly the sum."""
    answer = correct_answer(prompt)
    return answer is not None and completion.strip() == answer


def addition_reward(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """trl_ppo reward function: 1.0 per correct answer, 0.0 otherwise."""
    return [float(is_correct(p, c)) for p, c in zip(prompts, completions)]


class Recorder:
    """Counts the correct answers among the responses a reward scored, until `flush()` (once per update)."""

    def __init__(self) -> None:
        self.correct, self.total = 0, 0

    def add(self, flags: list[bool]) -> None:
        self.correct += sum(flags)
        self.total += len(flags)

    def flush(self) -> float | None:
        fraction = self.correct / self.total if self.total else None
        self.correct, self.total = 0, 0
        return fraction


def recording_reward(recorder: Recorder):
    """`addition_reward` that also tells `recorder` which answers were correct."""

    def addition_reward_recorded(prompts, completions, **columns):
        scores = addition_reward(prompts, completions, **columns)
        recorder.add([s == 1.0 for s in scores])
        return scores

    addition_reward_recorded.__name__ = "addition_reward"
    return addition_reward_recorded


# ------------------------------------------------------------------------------- the rule as a reward model
class _RuleBackbone(nn.Module):
    """Reads whole rows of prompt + response ids and returns, on every position, the row's rule score, as the
    one-feature last hidden state (so the score is the same wherever TRL reads it)."""

    def __init__(self, tokenizer, recorder: Recorder | None) -> None:
        super().__init__()
        self.tokenizer, self.recorder = tokenizer, recorder
        self.equals_id = tokenizer.convert_tokens_to_ids("=")

    def row_score(self, ids: list[int]) -> float:
        """ids: a row's attended tokens. The prompt ends at the first "="; the response is what follows, cut
        after its first EOS like trl_ppo's response mask, decoded without special tokens."""
        if self.equals_id not in ids:
            return 0.0
        split = ids.index(self.equals_id) + 1
        response = ids[split:]
        if self.tokenizer.eos_token_id in response:
            response = response[: response.index(self.tokenizer.eos_token_id) + 1]
        prompt = self.tokenizer.decode(ids[:split], skip_special_tokens=True)
        return float(is_correct(prompt, self.tokenizer.decode(response, skip_special_tokens=True)))

    def forward(self, input_ids, attention_mask=None, **kwargs):
        from transformers.modeling_outputs import BaseModelOutput

        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        scores = [self.row_score(row[keep].tolist()) for row, keep in zip(input_ids, mask)]
        if self.recorder is not None:
            self.recorder.add([s == 1.0 for s in scores])
        hidden = torch.tensor(scores, device=input_ids.device).view(-1, 1, 1).expand(-1, input_ids.size(1), 1)
        return BaseModelOutput(last_hidden_state=hidden, hidden_states=(hidden,))


class RuleRewardModel(nn.Module):
    """The addition rule in the shape of a sequence-classification reward model, for TRL 1.12's PPO trainer:
    `get_reward` calls `getattr(model, model.base_model_prefix)(input_ids, attention_mask, ...)` and applies
    `model.score` to `hidden_states[-1]`, then reads the result at the response's last non-pad token."""

    base_model_prefix = "rule"

    def __init__(self, tokenizer, recorder: Recorder | None = None) -> None:
        super().__init__()
        self.rule = _RuleBackbone(tokenizer, recorder)
        self.score = nn.Identity()

    def forward(self, input_ids, attention_mask=None, **kwargs):
        return self.score(self.rule(input_ids, attention_mask).hidden_states[-1])


# ------------------------------------------------------------------------------------------------- models
@dataclass(frozen=True)
class SFTSettings:
    hidden_size: int = 96
    num_layers: int = 3
    num_heads: int = 4
    steps: int = 600
    batch_size: int = 64
    learning_rate: float = 2e-3
    carry_slip: float = 0.0
    seed: int = 0

    def key(self) -> str:
        return "sft-" + "-".join(f"{k}{v}" for k, v in asdict(self).items())


def build_policy(tokenizer, settings: SFTSettings):
    return tiny_causal_lm(
        "gpt_neox", tokenizer, settings, max_position_embeddings=32, attention_dropout=0.0, hidden_dropout=0.0
    )


def tiny_causal_lm(model_type: str, tokenizer, settings, **extra):
    """A random-init causal LM of `model_type` shaped by `settings` (`hidden_size`, `num_layers`, `num_heads`,
    `seed`), with the tokenizer's vocabulary and special tokens; `extra` config fields on top."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        hidden_size=settings.hidden_size,
        num_hidden_layers=settings.num_layers,
        num_attention_heads=settings.num_heads,
        intermediate_size=4 * settings.hidden_size,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        num_labels=1,
        **extra,
    )
    torch.manual_seed(settings.seed)
    return AutoModelForCausalLM.from_config(config)


def demonstration(a: int, b: int, rng: random.Random, carry_slip: float) -> str:
    """The SFT target: the sum, except that with probability `carry_slip` a problem whose units carry forgets
    the carry (27+45 -> "62"), like a careless demonstrator; the reward knows better."""
    if (a % 10 + b % 10) >= 10 and rng.random() < carry_slip:
        return str(a + b - 10)
    return answer_text(a, b)


def sft_batch(tokenizer, problems: list[tuple[int, int]], answers: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Left-padded "a+b=c[EOS]" rows (c: `answers`, default the sums); labels only on the answer and EOS;
    position ids from the mask."""
    rows, labels = [], []
    answers = answers or [answer_text(a, b) for a, b in problems]
    for (a, b), answer_string in zip(problems, answers):
        prompt = tokenizer(prompt_text(a, b))["input_ids"]
        answer = tokenizer(answer_string)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    label_ids = torch.tensor([[-100] * (width - len(r)) + r for r in labels])
    attention_mask = (torch.arange(width) >= width - torch.tensor([len(r) for r in rows]).unsqueeze(1)).long()
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    return dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, labels=label_ids)


def train_sft(tokenizer, pool: list[tuple[int, int]], settings: SFTSettings, output_dir: str, log=print) -> str:
    """Train (or reuse) the SFT policy; -> the folder it is saved in (`<output_dir>/<settings key>`)."""
    path = os.path.join(output_dir, settings.key())
    if os.path.exists(os.path.join(path, "done.json")):
        return path
    model = build_policy(tokenizer, settings)
    sampler = random.Random(settings.seed)

    def step_loss() -> torch.Tensor:
        problems = sampler.sample(pool, settings.batch_size)
        answers = [demonstration(a, b, sampler, settings.carry_slip) for a, b in problems]
        return model(**sft_batch(tokenizer, problems, answers)).loss

    one_cycle_steps(model, settings, step_loss, log)
    return save_sft(model, tokenizer, settings, path)


def one_cycle_steps(model, settings, step_loss, log=print, name: str = "SFT", logs: int = 5) -> None:
    """`settings.steps` AdamW steps (a one-cycle schedule peaking at `settings.learning_rate`, gradients clipped to
    norm 1), each on the loss `step_loss()` returns; the loss logged `logs` times."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, settings.learning_rate, total_steps=settings.steps)
    model.train()
    for step in range(settings.steps):
        loss = step_loss()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if (step + 1) % max(1, settings.steps // logs) == 0:
            log(f"{name} step {step + 1}/{settings.steps}: loss {loss.item():.4f}")


def save_sft(model, tokenizer, settings, path: str) -> str:
    """Save an SFT policy and its tokenizer, then `done.json` (its settings): a folder without it is unfinished."""
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "done.json"), "w") as handle:
        json.dump(asdict(settings), handle)
    return path


def load_models(sft_path: str, value_seed: int):
    """(policy, value model): the SFT policy, and a one-label classifier with the SFT backbone and a score head
    drawn from `value_seed`."""
    from transformers import GPTNeoXForCausalLM, GPTNeoXForSequenceClassification

    policy = GPTNeoXForCausalLM.from_pretrained(sft_path)
    value_model = GPTNeoXForSequenceClassification.from_pretrained(sft_path, num_labels=1)
    torch.manual_seed(value_seed)  # the config's initializer range (0.02): values start near 0
    nn.init.normal_(value_model.score.weight, std=value_model.config.initializer_range)
    return policy, value_model


# ------------------------------------------------------------------------------------------------- accuracy
@torch.no_grad()
def greedy_accuracy(model, tokenizer, problems: list[tuple[int, int]], max_new_tokens: int) -> float:
    """Fraction of `problems` the model answers correctly with greedy decoding (stopping at EOS)."""
    was_training = model.training
    model.eval()
    prompts = [prompt_text(a, b) for a, b in problems]
    encoded = tokenizer(prompts, padding=True, return_tensors="pt")
    device = next(model.parameters()).device
    output = model.generate(
        input_ids=encoded["input_ids"].to(device),
        attention_mask=encoded["attention_mask"].to(device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    responses = output[:, encoded["input_ids"].size(1) :].tolist()
    correct = 0
    for prompt, response in zip(prompts, responses):
        if tokenizer.eos_token_id in response:
            response = response[: response.index(tokenizer.eos_token_id) + 1]
        correct += is_correct(prompt, tokenizer.decode(response, skip_special_tokens=True))
    model.train(was_training)
    return correct / len(problems)

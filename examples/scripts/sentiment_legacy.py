"""TRL's gpt2-sentiment notebook, for real, with trl <= 0.11's `step()` API (`trl_ppo.legacy`): SmolLM2-135M-Instruct
writes one-sentence movie reviews and VADER's compound score is the reward. The loop is the notebook's: `generate`,
score, `step`, `log_stats`. Offline and on the CPU:

    python examples/scripts/get_smollm2.py smollm2-135m-instruct
    python examples/scripts/sentiment_legacy.py --model smollm2-135m-instruct --steps 30

The settings are those of `trl-ppo train --config examples/configs/smollm2_sentiment.yaml`, in trl 0.11's terms
where it has them: the learning rate decays linearly to 0 over the steps (an `lr_scheduler`, which trl 0.11's
`PPOTrainer` takes), gradients are clipped to norm 1 (`max_grad_norm`), the new value head starts at zero (trl 0.11's
`v_head_init_strategy="normal"` with `v_head_initializer_range=0`) and learns alone in the first 5 steps
(`critic_warmup_steps`, a field of trl_ppo's own; trl 0.11 had no such option).

Before and after training it samples a review for each held-out prompt (the last 18 of the prompt file, which
training never sees; `--held_out`), prints their mean VADER score and a table of the first few.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from datasets import load_dataset
from transformers import AutoTokenizer

from trl_ppo.legacy import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer, create_reference_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sentiment_rewards import vader_scores  # noqa: E402

PROMPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "movie_review_prompts.jsonl")


def chat_dataset(tokenizer, path: str, held_out: int):
    """(training rows, the last `held_out` rows): `input_ids` of each chat prompt rendered with the chat template."""
    rows = load_dataset("json", data_files=path, split="train")
    rows = rows.map(lambda row: {"input_ids": tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True,
                                                                            return_dict=True)["input_ids"]})
    rows.set_format("torch", columns=["input_ids"], output_all_columns=True)
    return rows.select(range(len(rows) - held_out)), rows.select(range(len(rows) - held_out, len(rows)))


def held_out_reviews(ppo_trainer, held_out, generation_kwargs, seed: int) -> list[str]:
    torch.manual_seed(seed)  # the same draws before and after training
    queries = list(held_out["input_ids"])
    responses = ppo_trainer.generate(queries, batch_size=len(queries), return_prompt=False, **generation_kwargs)
    return ppo_trainer.tokenizer.batch_decode(responses, skip_special_tokens=True)


def ppo_config(args) -> PPOConfig:
    """trl 0.11's config of the run: `args.steps` steps of `args.batch_size` episodes, two epochs of two
    minibatches, a fixed KL coefficient (`tests/test_real_model.py` checks that it is the `trl-ppo` example's)."""
    return PPOConfig(model_name=args.model, steps=args.steps * args.batch_size, learning_rate=args.learning_rate,
                     batch_size=args.batch_size, mini_batch_size=args.batch_size // 2, ppo_epochs=2,
                     init_kl_coef=args.kl_coef, adap_kl_ctrl=False, max_grad_norm=args.max_grad_norm,
                     critic_warmup_steps=args.critic_warmup_steps, seed=args.seed)


def head_options(args) -> dict:
    """The new value head in trl 0.11's own terms: a std of 0 is a head of zeros (`value_head_init: zeros` in the
    trl-ppo example); 'normal' is trl_ppo's drawn head, std 1/sqrt(H+1) (the rows of RESULTS.md that say so)."""
    from transformers import AutoConfig

    std = 0.0 if args.value_head_init == "zeros" else (AutoConfig.from_pretrained(args.model).hidden_size + 1) ** -0.5
    return {"v_head_init_strategy": "normal", "v_head_initializer_range": std}


def make_trainer(args, tokenizer, train_rows) -> PPOTrainer:
    """The notebook's trainer: a value-head model, a frozen reference copy, the dataset and its collator; plus the
    optimizer and its linear decay (trl 0.11's `optimizer` and `lr_scheduler` arguments)."""
    config = ppo_config(args)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(args.model, **head_options(args))
    ref_model = create_reference_model(model)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate)
    decay = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.0, total_iters=args.steps)

    def collator(data):
        return {key: [d[key] for d in data] for key in data[0]}

    return PPOTrainer(config, model, ref_model, tokenizer, dataset=train_rows, data_collator=collator,
                      optimizer=optimizer, lr_scheduler=decay)


def train(ppo_trainer, tokenizer, generation_kwargs, steps: int) -> list[float]:
    """The notebook's loop for `steps` steps -> the mean score of each step's batch."""
    step, rewards_per_step = 0, []
    while step < steps:
        for batch in ppo_trainer.dataloader:
            query_tensors = batch["input_ids"]
            response_tensors = ppo_trainer.generate(query_tensors, return_prompt=False, **generation_kwargs)
            batch["query"] = tokenizer.batch_decode(query_tensors, skip_special_tokens=True)
            batch["response"] = tokenizer.batch_decode(response_tensors, skip_special_tokens=True)
            rewards = [torch.tensor(score) for score in vader_scores(batch["response"])]
            stats = ppo_trainer.step(query_tensors, response_tensors, rewards)
            ppo_trainer.log_stats(stats, batch, rewards)
            rewards_per_step.append(torch.stack(rewards).mean().item())
            step += 1
            print(f"step {step}: mean VADER {rewards_per_step[-1]:+.3f}, KL {stats['objective/kl']:.2f}", flush=True)
            if step == steps:
                break
    return rewards_per_step


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the folder get_smollm2.py wrote")
    parser.add_argument("--prompts", default=PROMPTS)
    parser.add_argument("--steps", type=int, default=30, help="PPO steps of --batch_size episodes")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=1e-5, help="decays linearly to 0 over --steps")
    parser.add_argument("--kl_coef", type=float, default=0.05, help="`init_kl_coef`, fixed (`adap_kl_ctrl=False`)")
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--critic_warmup_steps", type=int, default=5)
    parser.add_argument("--value_head_init", choices=("normal", "zeros"), default="zeros",
                        help="the new value head's weights: N(0, 1/(H+1)) (the core's 'normal'), or zeros (values 0 "
                        "until it learns)")
    parser.add_argument("--held_out", type=int, default=18, help="the last N prompts, never trained on (those of "
                        "the `trl-ppo` example's evaluation)")
    parser.add_argument("--response_length", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", default=None, help="append the before/after figures to this JSON-lines file")
    args = parser.parse_args(argv)
    if not 0 <= args.critic_warmup_steps < args.steps:
        parser.error(f"--critic_warmup_steps ({args.critic_warmup_steps}) must be in [0, --steps = {args.steps}): "
                     "the policy trains only after the warm-up")
    if args.held_out < 1:
        parser.error(f"--held_out must be at least 1, got {args.held_out}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(min(torch.get_num_threads(), os.cpu_count() or 1))
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")  # its pad token is <|im_end|>
    train_rows, held_out = chat_dataset(tokenizer, args.prompts, args.held_out)
    ppo_trainer = make_trainer(args, tokenizer, train_rows)
    generation_kwargs = {"min_length": -1, "top_k": 0.0, "top_p": 1.0, "do_sample": True,
                         "pad_token_id": tokenizer.eos_token_id, "max_new_tokens": args.response_length}

    before = held_out_reviews(ppo_trainer, held_out, generation_kwargs, args.seed)
    start, cpu_start = time.time(), time.process_time()
    rewards_per_step = train(ppo_trainer, tokenizer, generation_kwargs, args.steps)
    seconds, cpu_seconds = time.time() - start, time.process_time() - cpu_start  # CPU time: all threads
    after = held_out_reviews(ppo_trainer, held_out, generation_kwargs, args.seed)

    vader_before, vader_after = vader_scores(before), vader_scores(after)
    mean_before, mean_after = sum(vader_before) / len(before), sum(vader_after) / len(after)
    print(f"\nHeld-out mean VADER (sampled, {len(before)} prompts): {mean_before:+.3f} -> {mean_after:+.3f} "
          f"after {args.steps} steps ({seconds:.0f} s of training)\n")
    for i in range(min(6, len(held_out))):
        print(f"{held_out[i]['title']}\n  before ({vader_before[i]:+.2f}): {before[i]!r}\n"
              f"  after  ({vader_after[i]:+.2f}): {after[i]!r}")
    if args.json:
        with open(args.json, "a") as handle:
            settings = {key: getattr(args, key) for key in ("kl_coef", "max_grad_norm", "critic_warmup_steps",
                                                            "value_head_init")}
            row = {"api": "legacy", "seed": args.seed, "steps": args.steps, **settings, "vader_before": mean_before,
                   "vader_after": mean_after, "train_seconds": round(seconds, 1),
                   "train_cpu_seconds": round(cpu_seconds, 1), "threads": torch.get_num_threads(),
                   "load_average_1min": round(os.getloadavg()[0], 2), "train_rewards": rewards_per_step}
            handle.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

"""Learning parity of trl_ppo.legacy against TRL 0.11.4's own (first) PPOTrainer.

What it measures
    The same old-style `PPOTrainer.step()` loop (the gpt2-sentiment tutorial's), run once under either library with
    the same seed, the same tiny model and the same data: does trl_ppo.legacy learn as well as TRL 0.11.4 did?
    Only the imports differ between the two runs:

        --library trl      from trl import PPOConfig, PPOTrainer, AutoModelForCausalLMWithValueHead, ...
                           from trl.core import LengthSampler
        --library trl_ppo  from trl_ppo.legacy import (the same names)
                           from trl_ppo.legacy.core import LengthSampler

    Everything is offline and on the CPU: a 2-layer, 64-wide GPT-2 with a fixed initialisation seed (saved to a
    temporary folder and loaded back with `AutoModelForCausalLMWithValueHead.from_pretrained`, as a hub model would
    be), a word-level tokenizer built with the `tokenizers` library (pad = eos, as the tutorials set it), and prompts
    drawn from a small synthetic word list. The reward is a rule: the fraction of the response's words that are the
    target word ("gold"). A random model says it about one word in thirty; PPO raises that within a few dozen steps.

    Per step it records the batch's mean reward and `stats["objective/kl"]`; the JSON it writes holds the library,
    the package versions, the seed, those per-step series, `gain` (mean reward of the last 4 steps minus that of the
    first 4) and the wall time.

Commands (from the repository root; one training process at a time: this is a 2-core machine)
    .venv-trl011/bin/python benchmark/learning/legacy_parity.py --library trl --seed 0 --out trl_seed0.json
    .venv/bin/python benchmark/learning/legacy_parity.py --library trl_ppo --seed 0 --out trl_ppo_seed0.json
    bash benchmark/learning/legacy_parity.sh    # builds .venv-trl011, runs seeds 0,1,2 under both, prints the table

This file must run under TRL 0.11.4 (transformers 4.x) as well as under trl_ppo (transformers 5.x), so it imports
trl_ppo only when asked to, and uses nothing that differs between the two transformers major versions.
"""

import argparse
import glob
import importlib
import json
import os
import random
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, set_seed

# The benchmark's settings: the same for both libraries.
TARGET_WORD = "gold"
WORDS = (
    "red blue green black white gold silver stone river hill tree bird fish wolf bear cat dog horse "
    "run walk jump sing read write fast slow big small old new happy sad"
).split()
EOS = "<|endoftext|>"
UNK = "[UNK]"
MODEL_INIT_SEED = 1234  # the tiny GPT-2's weights are the same in every run, whatever --seed
NUM_PROMPTS = 64  # with batch_size 16: 4 PPO steps an epoch
PROMPT_WORDS = (2, 8)  # LengthSampler(2, 8): 2..7 words a prompt
RESPONSE_TOKENS = (4, 12)  # LengthSampler(4, 12): 4..11 new tokens a response
GAIN_WINDOW = 4  # gain = mean reward of the last 4 steps - that of the first 4


def import_library(name):
    """The five names the old scripts imported, from TRL itself or from trl_ppo.legacy."""
    package, core = ("trl", "trl.core") if name == "trl" else ("trl_ppo.legacy", "trl_ppo.legacy.core")
    lib, lib_core = importlib.import_module(package), importlib.import_module(core)
    return (
        lib.PPOConfig,
        lib.PPOTrainer,
        lib.AutoModelForCausalLMWithValueHead,
        lib.create_reference_model,
        lib_core.LengthSampler,
    )


def package_versions(library):
    names = ["torch", "transformers", "accelerate", "datasets", "tokenizers"]
    names.insert(0, "trl" if library == "trl" else "trl_ppo")
    found = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def build_tokenizer():
    """A word-level tokenizer over WORDS (ids 0..n-1), then unknown and end-of-text; pad is eos."""
    vocab = {word: i for i, word in enumerate(WORDS)}
    vocab[UNK] = len(vocab)
    vocab[EOS] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=UNK, eos_token=EOS, bos_token=EOS)
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def save_tiny_gpt2(folder, tokenizer):
    """A randomly initialised 2-layer, 64-wide GPT-2 (fixed seed) and its tokenizer, saved as a hub model would be."""
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=2,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(MODEL_INIT_SEED)
        model = GPT2LMHeadModel(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def build_dataset(tokenizer, seed, LengthSampler):
    """NUM_PROMPTS prompts of random words, tokenized the tutorial's way (input_ids, query; torch format)."""
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS[1])) for _ in range(NUM_PROMPTS)]
    input_size = LengthSampler(*PROMPT_WORDS)

    def tokenize(sample):
        sample["input_ids"] = tokenizer.encode(sample["review"])[: input_size()]
        sample["query"] = tokenizer.decode(sample["input_ids"])
        return sample

    dataset = Dataset.from_dict({"review": texts}).map(tokenize)
    dataset.set_format(type="torch")
    return dataset


def collator(data):
    return {key: [d[key] for d in data] for key in data[0]}


def reward(response_text):
    """The fraction of the response's words that are TARGET_WORD (the end-of-text token is no word)."""
    words = [w for w in response_text.split() if w != EOS]
    return sum(w == TARGET_WORD for w in words) / len(words) if words else 0.0


def train(library, seed, epochs, learning_rate, init_kl_coef):
    PPOConfig, PPOTrainer, AutoModelForCausalLMWithValueHead, create_reference_model, LengthSampler = import_library(
        library
    )
    set_seed(seed)  # python, numpy and torch: the value head's initialisation, the prompts' lengths
    tokenizer = build_tokenizer()
    with tempfile.TemporaryDirectory() as folder:
        save_tiny_gpt2(folder, tokenizer)
        config = PPOConfig(
            model_name=folder,
            learning_rate=learning_rate,
            batch_size=16,
            mini_batch_size=4,
            init_kl_coef=init_kl_coef,
            adap_kl_ctrl=True,
            seed=seed,
        )
        model = AutoModelForCausalLMWithValueHead.from_pretrained(folder)
        ref_model = create_reference_model(model)
    dataset = build_dataset(tokenizer, seed, LengthSampler)
    ppo_trainer = PPOTrainer(config, model, ref_model, tokenizer, dataset=dataset, data_collator=collator)

    generation_kwargs = {
        "min_length": -1,
        "top_k": 0.0,
        "top_p": 1.0,
        "do_sample": True,
        "pad_token_id": tokenizer.eos_token_id,
    }
    output_length_sampler = LengthSampler(*RESPONSE_TOKENS)

    mean_rewards, kls = [], []
    for epoch in range(epochs):
        for batch in ppo_trainer.dataloader:
            query_tensors = batch["input_ids"]
            response_tensors = ppo_trainer.generate(
                query_tensors, return_prompt=False, length_sampler=output_length_sampler, **generation_kwargs
            )
            batch["response"] = tokenizer.batch_decode(response_tensors)
            rewards = [torch.tensor(reward(text)) for text in batch["response"]]
            stats = ppo_trainer.step(query_tensors, response_tensors, rewards)
            mean_rewards.append(torch.stack(rewards).mean().item())
            kls.append(float(stats["objective/kl"]))
            print(
                f"epoch {epoch} step {len(mean_rewards):3d}  reward {mean_rewards[-1]:.3f}  kl {kls[-1]:+.3f}  "
                f"e.g. {batch['response'][0]!r}",
                flush=True,
            )
    return mean_rewards, kls


def mean_sd(values):
    mean = sum(values) / len(values)
    sd = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
    return mean, sd


def report(folder):
    """The markdown table of every result JSON in folder: per seed, then mean ± sd (sample), for each library."""
    runs = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            result = json.load(f)
        runs.setdefault(result["library"], []).append(result)
    names = {"trl": "trl " + str(runs.get("trl", [{}])[0].get("versions", {}).get("trl")), "trl_ppo": "trl_ppo.legacy"}
    columns = ["initial_reward", "final_reward", "gain", "run_mean_reward", "wall_s"]
    print("| library | seed | initial reward | final reward | gain | mean reward, all steps | wall s |")
    print("|---|---|---|---|---|---|---|")
    gains = {}
    for library in ("trl", "trl_ppo"):
        results = sorted(runs.get(library, []), key=lambda r: r["seed"])
        for r in results:
            cells = [f"{r[c]:.3f}" if c != "wall_s" else f"{r[c]:.0f}" for c in columns]
            print(f"| {names[library]} | {r['seed']} | " + " | ".join(cells) + " |")
        if results:
            stats = [mean_sd([r[c] for r in results]) for c in columns]
            cells = [
                f"{m:.3f} ± {sd:.3f}" if c != "wall_s" else f"{m:.0f} ± {sd:.0f}" for c, (m, sd) in zip(columns, stats)
            ]
            print(f"| **{names[library]}** | **mean ± sd ({len(results)} seeds)** | " + " | ".join(cells) + " |")
            gains[library] = [r["gain"] for r in results]
    print()
    if len(gains) == 2:
        (new_mean, new_sd), (old_mean, old_sd) = mean_sd(gains["trl_ppo"]), mean_sd(gains["trl"])
        verdict = "yes" if new_mean >= old_mean else "no"
        print(f"trl_ppo.legacy mean gain {new_mean:.3f} >= {names['trl']} mean gain {old_mean:.3f}: {verdict}")
        # How far apart the two means are, in standard errors of their difference (the seeds' spread is large).
        standard_error = (new_sd**2 / len(gains["trl_ppo"]) + old_sd**2 / len(gains["trl"])) ** 0.5
        difference = new_mean - old_mean
        print(
            f"difference {difference:+.3f} ± {standard_error:.3f} (standard error), "
            f"{difference / standard_error if standard_error else 0.0:+.1f} standard errors"
        )
    else:
        missing = [names[lib] for lib in ("trl", "trl_ppo") if lib not in gains]
        print(f"no results for: {', '.join(missing)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--library", choices=["trl", "trl_ppo"], help="which library's PPOTrainer to train with")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="JSON file to write")
    parser.add_argument("--epochs", type=int, default=10, help="passes over the 64 prompts (4 steps each)")
    parser.add_argument("--learning_rate", type=float, default=3e-4)
    parser.add_argument("--init_kl_coef", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--report", metavar="FOLDER", help="print the markdown table of the JSON files in FOLDER")
    args = parser.parse_args()
    if args.report:
        report(args.report)
        return
    if not (args.library and args.out):
        parser.error("--library and --out are needed to train (or --report FOLDER)")

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    mean_rewards, kls = train(args.library, args.seed, args.epochs, args.learning_rate, args.init_kl_coef)
    wall_s = time.perf_counter() - start

    first = sum(mean_rewards[:GAIN_WINDOW]) / GAIN_WINDOW
    last = sum(mean_rewards[-GAIN_WINDOW:]) / GAIN_WINDOW
    result = {
        "library": args.library,
        "versions": package_versions(args.library),
        "seed": args.seed,
        "settings": {
            "epochs": args.epochs,
            "steps": len(mean_rewards),
            "learning_rate": args.learning_rate,
            "init_kl_coef": args.init_kl_coef,
            "batch_size": 16,
            "mini_batch_size": 4,
            "target_word": TARGET_WORD,
            "model_init_seed": MODEL_INIT_SEED,
            "threads": args.threads,
        },
        "mean_reward": mean_rewards,
        "kl": kls,
        "initial_reward": first,
        "final_reward": last,
        "gain": last - first,
        "run_mean_reward": sum(mean_rewards) / len(mean_rewards),
        "wall_s": wall_s,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"{args.library} seed {args.seed}: reward {first:.3f} -> {last:.3f} (gain {last - first:+.3f}), "
        f"{wall_s:.0f} s; wrote {args.out}"
    )


if __name__ == "__main__":
    main()

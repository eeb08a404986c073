"""The embedded default job: everything `trl-ppo` needs to train with no network and no arguments.

* prompts: `default_data/prompts.jsonl` ("the movie was", "my day felt", ...), shipped in the package;
* tokenizer: a word-level tokenizer built with `tokenizers` over a small vocabulary;
* policy / value model: tiny random-init GPT-NeoX models built from a config;
* reward: `sentiment_reward`, the share of a completion's words that are positive minus the share that are
  negative (in [-1, 1]), with `missing_eos_penalty` for a completion that does not end: the completions table
  shows the policy learning to answer with a word of praise and stop. A bounded reward that does not grow with
  length keeps the run healthy by the README's table (an unbounded count of positive words made the policy
  fill every response, never stop, and drift to a KL of about 14 nats while the value loss rose);
* `positive_words_reward` (+1 per positive word, -1 per negative word) is kept for tests and examples.
"""

from __future__ import annotations

import json
from importlib import resources

from datasets import Dataset

from .script_args import as_flags

POSITIVE_WORDS = (
    "good great happy wonderful excellent amazing lovely fun nice brilliant beautiful perfect joyful bright "
    "delightful fantastic pleasant superb warm cheerful"
).split()
NEGATIVE_WORDS = (
    "bad awful sad terrible boring ugly horrible poor dull gloomy dreadful annoying painful cold nasty grim "
    "tiresome bleak messy weak"
).split()
NEUTRAL_WORDS = (
    "and but so very quite really rather a an the it this that was is felt seemed looked sounded turned out "
    "to of in on at with for my our your their day movie trip book food team weather concert phone game morning "
    "class hotel city song garden new old long short big small again today yesterday later then also just "
    "some many more most all every time people place thing way kind part , . i we you they think honestly fair "
    "overall be in short user assistant system :"
).split()
SPECIAL_TOKENS = {"pad_token": "[PAD]", "eos_token": "[EOS]", "unk_token": "[UNK]"}


def default_vocabulary() -> list[str]:
    """Special tokens first, then every word once, in a fixed order."""
    words = list(SPECIAL_TOKENS.values())
    for word in POSITIVE_WORDS + NEGATIVE_WORDS + NEUTRAL_WORDS:
        if word not in words:
            words.append(word)
    return words


def build_word_tokenizer(words: list[str] | None = None):
    """A `PreTrainedTokenizerFast` splitting on whitespace and punctuation, one id per word, left padding,
    `[PAD]` / `[EOS]` / `[UNK]` special tokens and a one-line chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocabulary = {word: index for index, word in enumerate(words or default_vocabulary())}
    backend = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token=SPECIAL_TOKENS["unk_token"]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, padding_side="left", **SPECIAL_TOKENS)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
        "{% if add_generation_prompt %}assistant : {% endif %}"
    )
    return tokenizer


def build_tiny_models(tokenizer, hidden_size: int = 64, num_layers: int = 2, seed: int = 0):
    """(policy, value_model): random-init GPT-NeoX causal LM and a one-label sequence classifier."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXForSequenceClassification

    config = GPTNeoXConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        intermediate_size=4 * hidden_size,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        num_labels=1,
    )
    torch.manual_seed(seed)
    policy = GPTNeoXForCausalLM(config)
    value_model = GPTNeoXForSequenceClassification(config)
    return policy, value_model


def sentiment_reward(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """(positive words - negative words) / words of each completion, in [-1, 1]; 0 for an empty completion."""
    positive, negative = set(POSITIVE_WORDS), set(NEGATIVE_WORDS)
    scores = []
    for text in completions:
        words = text.split()
        scores.append(sum((w in positive) - (w in negative) for w in words) / len(words) if words else 0.0)
    return scores


def positive_words_reward(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """+1 for each positive word, -1 for each negative word in each completion."""
    positive, negative = set(POSITIVE_WORDS), set(NEGATIVE_WORDS)
    return [float(sum((w in positive) - (w in negative) for w in text.split())) for text in completions]


def default_prompts() -> Dataset:
    """The shipped prompt set as a `datasets.Dataset` with a text `prompt` column."""
    text = resources.files("trl_ppo").joinpath("default_data/prompts.jsonl").read_text(encoding="utf-8")
    return Dataset.from_list([json.loads(line) for line in text.splitlines() if line.strip()])


# Hyper-parameters of the default job. They are passed as command-line flags before the user's, so any flag the
# user gives wins.
DEFAULT_JOB_SETTINGS = {
    "output_dir": "trl_ppo_default_run",
    "learning_rate": 1e-3,
    "per_device_train_batch_size": 16,
    "gradient_accumulation_steps": 2,
    "num_ppo_epochs": 4,
    "num_mini_batches": 1,
    "total_episodes": 3200,
    "response_length": 12,
    "temperature": 1.0,
    "kl_coef": 0.1,
    "stop_token": "eos",
    "missing_eos_penalty": 1.0,
    "num_sample_generations": 4,
    "per_device_eval_batch_size": 8,
    "logging_steps": 10,
    "save_strategy": "no",
    "report_to": "none",
    "seed": 1,
}
DEFAULT_JOB_FLAGS = as_flags(DEFAULT_JOB_SETTINGS)

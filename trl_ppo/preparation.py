"""What `PPOTrainer.__init__` does before `transformers.Trainer` takes over: the inputs checked (before any
compute), the prompts prepared, the models made ready for PPO, and what must match on resume fingerprinted."""

from __future__ import annotations

from torch import nn

from . import checkpoint as ckpt
from .config import OnPolicyConfig
from .config_checks import validate_config
from .data import check_datasets, prepare_prompts
from .models import (
    check_vocabularies,
    context_length,
    gradient_checkpointing_kwargs,
    prepare_models,
    vocabulary_size,
)
from .rewards import Reward, build_rewards, models_reading_policy_ids


def validate_inputs(args, tokenizer, reward_model, reward_processing_class) -> list[Reward]:
    """Check the config, the tokenizer and the rewards -> the rewards, named and weighted."""
    if not isinstance(args, OnPolicyConfig):
        raise TypeError(f"`args` must be a `PPOConfig`, got {type(args).__name__}.")
    validate_config(args)
    if tokenizer is None:
        raise ValueError(
            "`processing_class` (the policy's tokenizer) is None: the trainer needs it to tokenize prompts, pad them "
            "and decode responses. Pass `processing_class=AutoTokenizer.from_pretrained(path)`."
        )
    if tokenizer.pad_token_id is None:
        raise ValueError(
            "The tokenizer has no pad token, which left-padding of prompts needs. Add one, e.g. "
            "`tokenizer.add_special_tokens({'pad_token': '[PAD]'})` (resize the model's embeddings if the "
            "new id is outside them) or `tokenizer.pad_token = tokenizer.eos_token`."
        )
    if args.stop_token_id is not None and not 0 <= args.stop_token_id < len(tokenizer):
        raise ValueError(
            f"`stop_token_id` ({args.stop_token_id}) is outside the tokenizer's vocabulary (ids 0 to "
            f"{len(tokenizer) - 1}): no response could ever stop. Use an id the tokenizer has."
        )
    return build_rewards(reward_model, args.reward_weights, reward_processing_class)


def prepare_data(args, tokenizer, train_dataset, eval_dataset, policy: nn.Module) -> tuple:
    """Both prompt datasets with `input_ids`, cut to `max_prompt_length` and checked against the policy's context
    and against the config -> (train_dataset, eval_dataset); each may be None."""
    context, vocab = context_length(policy), vocabulary_size(policy, tokenizer)
    train_dataset = prepare_prompts(train_dataset, tokenizer, args, context, "train_dataset", vocab)
    eval_dataset = prepare_prompts(eval_dataset, tokenizer, args, context, "eval_dataset", vocab)
    check_datasets(args, train_dataset, eval_dataset)
    return train_dataset, eval_dataset


def initial_fingerprints(policy, ref_model, value_model, rewards: list[Reward], train_dataset=None) -> dict:
    """A fingerprint of every model the run starts from, by role (a resume must start from the same ones), and of
    the prepared prompts (`train_dataset`: compared on resume, see `identity.prompts_changes`)."""
    models = {"policy": policy, "ref_model": ref_model, "value_model": value_model}
    models.update({f"reward:{reward.name}": reward.source for reward in rewards if reward.is_model})
    fingerprints = {f"{name}_fingerprint": ckpt.model_fingerprint(module) for name, module in models.items()}
    return {**fingerprints, "train_dataset": ckpt.prompts_fingerprint(train_dataset)}


def prepare_all_models(args, tokenizer, policy, ref_model, value_model, rewards: list[Reward], peft_config) -> tuple:
    """`models.prepare_models` (PEFT adapter, reference copy, no dropout, gradient checkpointing), then every model
    that reads the policy's token ids checked to have an embedding for each -> (policy, ref_model)."""
    policy, ref_model = prepare_models(
        policy,
        ref_model,
        value_model,
        [reward.source for reward in rewards],
        peft_config,
        gradient_checkpointing_kwargs(args),
    )
    readers = {"model": policy, "ref_model": ref_model, "value_model": value_model}
    check_vocabularies(tokenizer, {**readers, **models_reading_policy_ids(rewards)})
    return policy, ref_model

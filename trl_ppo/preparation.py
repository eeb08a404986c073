"""What `PPOTrainer.__init__` does before `transformers.Trainer` takes over: the inputs checked (before any
compute), the prompts prepared, the models made ready for PPO, and what must match on resume fingerprinted."""

from __future__ import annotations

import difflib
import functools
import inspect

from torch import nn
from transformers.utils import logging

from . import checkpoint as ckpt
from .config import OnPolicyConfig
from .config_checks import check_deadlines_fit_process_group, validate_config
from .data import check_datasets, prepare_prompts, require_pad_token
from .estimators import uses_critic
from .models import (
    check_causal_lm,
    check_vocabularies,
    context_length,
    gradient_checkpointing_kwargs,
    prepare_models,
    vocabulary_size,
    with_value_function,
)
from .reward_functions import check_reward_columns
from .rewards import Reward, build_rewards, models_reading_policy_ids
from .saving import check_writable
from .value_head import is_value_head_model

logger = logging.get_logger(__name__)

# Argument names of TRL's earlier PPO trainers -> what to pass here instead.
RENAMED_ARGUMENTS = {
    "config": "`args=` (a `trl_ppo.PPOConfig`)",
    "tokenizer": "`processing_class=`",
    "policy": "`model=`",
    "ref_policy": "`ref_model=`",
    "dataset": "`train_dataset=`",
    "optimizer": "`optimizers=(optimizer, lr_scheduler)`",
    "lr_scheduler": "`optimizers=(optimizer, lr_scheduler)`",
    "num_shared_layers": "`ref_model=create_reference_model(model, num_shared_layers=n)`",
}
LEGACY_ONLY = ("dataset", "optimizer", "lr_scheduler", "num_shared_layers")  # trl <= 0.11's step-API trainer


def refuse_old_names(init):
    """Wrap `PPOTrainer.__init__` so that a keyword argument it does not take fails saying what to pass instead:
    for a name of TRL's earlier trainers (`RENAMED_ARGUMENTS`) the one used here, for any other the closest
    accepted name (Python's own error names only what is wrong)."""
    accepted = [name for name in inspect.signature(init).parameters if name != "self"]

    @functools.wraps(init)
    def checked_init(self, *args, **kwargs):
        unknown = [name for name in kwargs if name not in accepted]
        if unknown:
            raise TypeError(f"{type(self).__name__}: " + " ".join(_instead(name, accepted) for name in unknown))
        return init(self, *args, **kwargs)

    return checked_init


def _instead(name: str, accepted: list[str]) -> str:
    if name in RENAMED_ARGUMENTS:
        legacy = " (or `trl_ppo.legacy.PPOTrainer`, which keeps trl 0.11's `step()` API)" if name in LEGACY_ONLY else ""
        return f"`{name}=` is the name in older TRL releases; pass {RENAMED_ARGUMENTS[name]}{legacy}."
    close = difflib.get_close_matches(name, accepted, n=1)
    hint = f"did you mean `{close[0]}=`?" if close else f"it takes {', '.join(accepted)}."
    return f"there is no argument `{name}=`: {hint}"


def validate_inputs(args, tokenizer, reward_model, reward_processing_class, environment_factory=None) -> list[Reward]:
    """Check the config, the tokenizer and the rewards -> the rewards, named and weighted (none yet for
    `reward_model=[]` with an `environment_factory`: its `get_reward` is added by `agents.runner.agent_runner`)."""
    if not isinstance(args, OnPolicyConfig):
        kind = f"{type(args).__module__}.{type(args).__qualname__}"
        legacy = " (for trl 0.11's config, use `trl_ppo.legacy.PPOTrainer`)" if "legacy" in kind else ""
        raise TypeError(f"`args` must be a `trl_ppo.PPOConfig`, got {kind}{legacy}.")
    validate_config(args)
    check_writable(args.output_dir)  # before `Trainer` creates it, and not at the first checkpoint or the end
    if tokenizer is None:
        raise ValueError(
            "`processing_class` (the policy's tokenizer) is None: the trainer needs it to tokenize prompts, pad them "
            "and decode responses. Pass `processing_class=AutoTokenizer.from_pretrained(path)`."
        )
    if args.stop_token_id is not None and not 0 <= args.stop_token_id < len(tokenizer):
        raise ValueError(
            f"`stop_token_id` ({args.stop_token_id}) is outside the tokenizer's vocabulary (ids 0 to "
            f"{len(tokenizer) - 1}): no response could ever stop. Use an id the tokenizer has."
        )
    environments = environment_factory is not None
    check_deadlines_fit_process_group(args, environments)
    return build_rewards(reward_model, args.reward_weights, reward_processing_class, environments)


def policy_to_train(args, model: nn.Module, value_model: nn.Module | None) -> nn.Module:
    """The policy with its value function (`models.with_value_function`), or for a critic-free
    `advantage_estimator` `model` itself: a `value_model`, or a value head on `model`, would be held and saved but
    never trained, so either is refused with the fix, and the log says that no value metrics will come."""
    estimator = args.advantage_estimator
    if uses_critic(estimator):
        return with_value_function(model, value_model, args.seed, args.value_head_init)
    check_causal_lm(model)
    if value_model is not None or is_value_head_model(model):
        given = "a `value_model` was given" if value_model is not None else "`model` has a value head"
        instead = "pass `value_model=None`" if value_model is not None else "pass `model.pretrained_model`"
        raise ValueError(
            f"`advantage_estimator={estimator!r}` is critic-free (no value function is trained), but {given}: "
            f"{instead}, or use `advantage_estimator='gae'` to train it."
        )
    logger.warning(
        f"`advantage_estimator={estimator!r}`: critic-free, so no value model or value head is built and no value "
        "loss runs; the logs have no `loss/value_avg` or `val/clipfrac_avg`."
    )
    return model


def prepare_data(
    args, tokenizer, train_dataset, eval_dataset, policy: nn.Module, rewards: list[Reward], passed: tuple = ()
) -> tuple:
    """Both prompt datasets with `input_ids`, cut to `max_prompt_length` and checked against the policy's context,
    the config and what the reward functions take (the columns, and the `passed` arguments the trainer adds) ->
    (train_dataset, eval_dataset); each may be None."""
    if train_dataset is not None or eval_dataset is not None:
        require_pad_token(tokenizer.pad_token_id, "left-padding the prompts")
    context, vocab = context_length(policy), vocabulary_size(policy, tokenizer)
    train_dataset = prepare_prompts(train_dataset, tokenizer, args, context, "train_dataset", vocab)
    eval_dataset = prepare_prompts(eval_dataset, tokenizer, args, context, "eval_dataset", vocab)
    check_datasets(args, train_dataset, eval_dataset)
    check_reward_columns(rewards, train_dataset, "train_dataset", passed)
    check_reward_columns(rewards, eval_dataset, "eval_dataset", passed)
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

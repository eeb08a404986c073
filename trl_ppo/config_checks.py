"""Checks of a config before any model is touched (`validate_config`), and the batch sizes derived from it once
the number of processes is known (`compute_batch_sizes`)."""

from __future__ import annotations

import math
import os

from transformers.utils import logging

from .agents.templates import SHIPPED
from .config import OnPolicyConfig, PPOConfig
from .config_agents import check_agent_options
from .config_asynchronous import check_async_options
from .config_fields import check_fields
from .config_vllm import check_vllm_options
from .deadlines import Deadlines
from .estimators import CRITIC_FREE, ESTIMATORS, SCALE_REWARDS, uses_critic
from .kl import KL_ESTIMATORS
from .losses import LOSS_AGG_MODES
from .value_head import VALUE_HEAD_INITS

logger = logging.get_logger(__name__)


def _exact_div(numerator: int, denominator: int, what: str, numerator_name: str, denominator_name: str) -> int:
    if denominator <= 0 or numerator % denominator != 0:
        raise ValueError(
            f"{what}: `{numerator_name}` ({numerator}) must be a multiple of `{denominator_name}` ({denominator})."
        )
    return numerator // denominator


def samples_per_prompt(args: OnPolicyConfig) -> int:
    """`num_generations`: the episodes each prompt of a batch gives (1 for a config without the field)."""
    return getattr(args, "num_generations", 1)


def total_episodes(args: OnPolicyConfig, train_dataset_len: int) -> int:
    """The run's episodes: `max_steps` updates of `batch_size` when set (as in `transformers`, where it overrides
    `num_train_epochs`), else `total_episodes`, else `num_train_epochs` passes over the prompts (each prompt
    `num_generations` episodes)."""
    if args.max_steps > 0:
        episodes = args.max_steps * args.batch_size
        if args.total_episodes is not None and args.total_episodes != episodes:
            logger.warning(
                f"`max_steps` ({args.max_steps}) overrides `total_episodes` ({args.total_episodes}): {args.max_steps} "
                f"update(s) of `batch_size` ({args.batch_size}) episodes, {episodes} episodes in all."
            )
        return episodes
    if args.total_episodes is None:
        return int(args.num_train_epochs * train_dataset_len * samples_per_prompt(args))
    return args.total_episodes


def compute_batch_sizes(args: OnPolicyConfig, world_size: int, train_dataset_len: int) -> None:
    """Fill the derived batch sizes of `args` in place, raising a clear error when a division is inexact."""
    args.world_size = world_size
    args.local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps
    args.micro_batch_size = args.per_device_train_batch_size * world_size
    args.batch_size = args.local_batch_size * world_size
    args.total_episodes = total_episodes(args, train_dataset_len)
    args.mini_batch_size = _exact_div(
        args.batch_size,
        args.num_mini_batches,
        "Cannot split a batch into minibatches",
        "batch_size",
        "num_mini_batches",
    )
    args.local_mini_batch_size = _exact_div(
        args.local_batch_size,
        args.num_mini_batches,
        "Cannot split a process's batch into minibatches",
        "local_batch_size = per_device_train_batch_size * gradient_accumulation_steps",
        "num_mini_batches",
    )
    # As in TRL: a minibatch is cut into micro-batches of `per_device_train_batch_size` (the last may be smaller,
    # and a minibatch smaller than one micro-batch is one micro-batch); its loss does not depend on the split.
    micro_batch = min(args.per_device_train_batch_size, args.local_mini_batch_size)
    if args.train_forward_batch_size is None or args.train_forward_batch_size == args.per_device_train_batch_size:
        args.train_forward_batch_size = micro_batch  # one micro-batch per pass
    else:
        _exact_div(
            args.train_forward_batch_size,
            micro_batch,
            "A training forward must hold whole micro-batches",
            "train_forward_batch_size",
            "per_device_train_batch_size",
        )
        _exact_div(
            args.local_mini_batch_size,
            args.train_forward_batch_size,
            "Cannot split a minibatch into training forwards",
            "local_mini_batch_size",
            "train_forward_batch_size",
        )
    if args.total_episodes < args.batch_size:  # TRL accepts it and trains one batch; so do we, but say so
        logger.warning(
            f"`total_episodes` ({args.total_episodes}) is smaller than one batch (`batch_size` = {args.batch_size} = "
            "per_device_train_batch_size * gradient_accumulation_steps * processes): training one batch."
        )
    args.num_total_batches = math.ceil(args.total_episodes / args.batch_size)
    prompts_drawn = args.total_episodes / samples_per_prompt(args)
    if train_dataset_len and prompts_drawn > 100 * train_dataset_len:
        logger.warning(
            f"`total_episodes` ({args.total_episodes}) makes {prompts_drawn / train_dataset_len:.0f} passes over "
            f"the {train_dataset_len} prompts of `train_dataset`: the policy may overfit them. Intended?"
        )
    warmup = getattr(args, "critic_warmup_steps", 0)
    if warmup >= args.num_total_batches:
        fail(
            f"`critic_warmup_steps` ({warmup}) must be smaller than the number of updates ({args.num_total_batches}"
            " = ceil(total_episodes / batch_size)): otherwise the policy never trains."
        )


def stop_and_penalty_tokens(args: OnPolicyConfig, tokenizer) -> tuple[int | None, int | None]:
    """(the token that ends a response or None, the token whose absence `missing_eos_penalty` punishes: the stop
    token, else EOS as in TRL)."""
    stop_token_id = tokenizer.eos_token_id if args.stop_token == "eos" else args.stop_token_id
    if args.stop_token == "eos" and stop_token_id is None and args.missing_eos_penalty is not None:
        logger.warning(
            "`stop_token='eos'` with a tokenizer that has no EOS token: responses are not cut, and "
            "`missing_eos_penalty` never applies. Set the tokenizer's `eos_token`, or `stop_token_id`."
        )
    elif args.missing_eos_penalty is not None and stop_token_id is None:
        logger.warning(
            "`missing_eos_penalty` is set without a stop token: responses are not cut at EOS, and the penalty "
            "applies to those with no EOS anywhere. Set `stop_token='eos'` to end responses at EOS."
        )
    return stop_token_id, stop_token_id if stop_token_id is not None else tokenizer.eos_token_id


def fail(message: str) -> None:
    raise ValueError(message)


def validate_config(args: OnPolicyConfig) -> None:
    """Reject values that cannot work, before any model is touched. Each error names the argument and the fix."""
    check_fields(args)  # again: a field may have been changed since the config was made
    if args.response_length < 1:
        fail(f"`response_length` must be at least 1, got {args.response_length}.")
    if args.stop_token not in (None, "eos"):
        fail(f"Unknown `stop_token` {args.stop_token!r}: use 'eos', or `stop_token_id` for another token.")
    if args.stop_token is not None and args.stop_token_id is not None:
        fail(f"`stop_token` ({args.stop_token!r}) and `stop_token_id` ({args.stop_token_id}) are both set: keep one.")
    if args.generation_backend not in ("auto", "kv_cache", "compiled", "compiled_loop", "generate", "vllm"):
        fail(
            f"Unknown `generation_backend` {args.generation_backend!r}: use 'auto', 'kv_cache', 'compiled', "
            "'compiled_loop', 'generate' or 'vllm'."
        )
    if args.logprobs_chunk_size < 0:
        fail(f"`logprobs_chunk_size` must be >= 0 (0: no chunking), got {args.logprobs_chunk_size}.")
    if args.train_forward_batch_size is not None and args.train_forward_batch_size < 1:
        fail(f"`train_forward_batch_size` must be at least 1, got {args.train_forward_batch_size}.")
    for name in (
        "num_mini_batches",
        "local_rollout_forward_batch_size",
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
    ):
        if getattr(args, name) < 1:
            fail(f"`{name}` must be at least 1, got {getattr(args, name)}.")
    if args.total_episodes is not None and args.total_episodes < 1:
        fail(f"`total_episodes` must be at least 1, got {args.total_episodes}.")
    if args.max_prompt_length is not None and args.max_prompt_length < 1:
        fail(f"`max_prompt_length` must be at least 1 (or None: no cut), got {args.max_prompt_length}.")
    if args.learning_rate == 0:
        logger.warning("`learning_rate` is 0: the policy and value function will not change.")
    check_trainer_features(args)
    if isinstance(args, PPOConfig):
        _validate_ppo_config(args)


# torch's shortest default collective timeout (NCCL's), the limit where `ddp_timeout` is None
DEFAULT_COLLECTIVE_TIMEOUT = 600


def check_deadlines_fit_process_group(args, environments: bool, world_size: int | None = None) -> None:
    """In a run of several processes (`world_size`, by default `WORLD_SIZE`), a retried call into user code must end
    (in `UserCallError` on every process) before the others, waiting in the next collective, hit `ddp_timeout` and
    die without saying why: reward functions always, environments' `reset` / `get_reward` with `environments`."""
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    if world_size < 2:
        return
    deadlines = Deadlines.from_config(args)
    limit = getattr(args, "ddp_timeout", None) or DEFAULT_COLLECTIVE_TIMEOUT
    which = f"{limit:g} s" if getattr(args, "ddp_timeout", None) else f"{limit:g} s, torch's default where it is None"
    bounded = [("reward_timeout", deadlines.reward)] + [("environment_timeout", deadlines.environment)] * environments
    for setting, seconds in bounded:
        bound = deadlines.call_bound(seconds)
        if bound is None or bound < limit:  # None: no limit, the user's choice (a hang then hangs every process)
            continue
        fail(
            f"`{setting}` with `user_call_retries` lets one call take {bound:g} s ({deadlines.retries + 1} tries of "
            f"{seconds:g} s, and the backoff), not less than `ddp_timeout` "
            f"({which}) in this run of {world_size} processes: the others would die waiting for it in a collective "
            f"instead of stopping with the error that names it. Lower `{setting}` or `user_call_retries`, or raise "
            "`ddp_timeout`."
        )


# `TrainingArguments` fields for features of `Trainer.train()` that PPO's own loop does not run: (field, its value
# that means "off", what to do instead). Absent fields (older transformers) are skipped.
UNSUPPORTED_TRAINER_FEATURES = (
    (
        "load_best_model_at_end",
        False,
        "checkpoints are not ranked by a metric; pick one by `eval_objective/scores` in the log instead",
    ),
    ("auto_find_batch_size", False, "set `per_device_train_batch_size` (and `train_forward_batch_size`) yourself"),
    ("neftune_noise_alpha", None, "PPO samples its own responses; NEFTune noise is for supervised fine-tuning"),
    ("label_smoothing_factor", 0.0, "PPO has no labels to smooth"),
    ("train_sampling_strategy", "random", "prompts are drawn in a seeded random order (`data_seed`)"),
    ("group_by_length", False, "prompts are drawn in a seeded random order (`data_seed`)"),
    ("torch_empty_cache_steps", None, "call `torch.cuda.empty_cache()` from a callback's `on_step_end` instead"),
)


def check_trainer_features(args) -> None:
    """Refuse a `TrainingArguments` feature that `Trainer.train()` has and PPO's loop would silently ignore."""
    for name, off, instead in UNSUPPORTED_TRAINER_FEATURES:
        value = getattr(args, name, off)
        if value != off:
            fail(f"`{name}={value!r}` is a feature of `Trainer.train()` that `PPOTrainer` does not have: {instead}.")


def _validate_ppo_config(args: PPOConfig) -> None:
    """`validate_config`'s checks of PPO's own fields."""
    if args.kl_estimator not in KL_ESTIMATORS:
        fail(f"Unknown `kl_estimator` {args.kl_estimator!r}: use 'k1', 'k2' or 'k3'.")
    if args.num_ppo_epochs < 1:
        fail(f"`num_ppo_epochs` must be at least 1, got {args.num_ppo_epochs}.")
    for name in ("cliprange", "cliprange_value"):
        if not getattr(args, name) > 0:
            fail(f"`{name}` must be > 0, got {getattr(args, name)}.")
    if args.kl_target is not None:
        if not args.kl_target > 0:
            fail(f"`kl_target` must be > 0 (or None to keep `kl_coef` fixed), got {args.kl_target}.")
        if not args.kl_coef > 0:
            fail(f"Adaptive KL control multiplies `kl_coef`, so it must be > 0 with `kl_target`, got {args.kl_coef}.")
    if args.kl_penalty not in ("kl", "abs", "mse", "full"):
        fail(f"Unknown `kl_penalty` {args.kl_penalty!r}: use 'kl', 'abs', 'mse' or 'full'.")
    if args.value_head_init not in VALUE_HEAD_INITS:
        fail(f"Unknown `value_head_init` {args.value_head_init!r}: use 'zeros' or 'normal'.")
    if args.kl_penalty != "kl" and args.kl_estimator != "k1":
        fail(
            f"`kl_penalty={args.kl_penalty!r}` replaces the KL estimator, and `kl_estimator={args.kl_estimator!r}` "
            "asks for another one: keep `kl_estimator='k1'` (the default), or use `kl_penalty='kl'` with it."
        )
    if args.use_score_norm and not args.use_score_scaling:
        fail("`use_score_norm` normalises the scaled scores: it needs `use_score_scaling=True`.")
    if args.score_clip is not None and not args.score_clip > 0:
        fail(f"`score_clip` must be > 0 (scores are clipped to +-score_clip), got {args.score_clip}.")
    if not args.target_kl > 0:
        fail(f"`target_kl` must be > 0, got {args.target_kl}.")
    if args.ratio_threshold is not None and not args.ratio_threshold > 1:
        fail(
            f"`ratio_threshold` must be > 1 (the mean ratio is about 1 in a healthy minibatch), got "
            f"{args.ratio_threshold}."
        )
    for name in ("gamma", "lam"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            fail(f"`{name}` must be in [0, 1], got {getattr(args, name)}.")
    if args.gae_level not in ("token", "turn"):
        fail(f"Unknown `gae_level` {args.gae_level!r}: use 'token' (GAE over model tokens) or 'turn' (over turns).")
    _validate_critic_options(args)
    _validate_large_scale_options(args)
    _validate_estimator(args)
    check_async_options(args, fail)
    check_agent_options(args, fail)
    check_vllm_options(args, fail)


def _validate_critic_options(args: PPOConfig) -> None:
    """The critic's own settings (`config_critic.py`)."""
    if args.num_critic_epochs < 1:
        fail(f"`num_critic_epochs` must be at least 1 (1: the value trains with the policy only), got "
             f"{args.num_critic_epochs}.")
    if args.critic_learning_rate is not None and not args.critic_learning_rate > 0:
        fail(f"`critic_learning_rate` must be > 0 (or None: the value function trains at `learning_rate`), got "
             f"{args.critic_learning_rate}.")
    if args.critic_warmup_epochs is not None and args.critic_warmup_epochs < 1:
        fail(f"`critic_warmup_epochs` must be at least 1 (or None: `num_ppo_epochs * num_critic_epochs`), got "
             f"{args.critic_warmup_epochs}.")


def _validate_large_scale_options(args: PPOConfig) -> None:
    """The options from large-scale RL systems: each value, and the combinations that cannot mean anything."""
    if args.loss_agg_mode not in LOSS_AGG_MODES:
        fail(f"Unknown `loss_agg_mode` {args.loss_agg_mode!r}: use one of {', '.join(LOSS_AGG_MODES)}.")
    for name in ("cliprange_low", "cliprange_high"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            fail(f"`{name}` must be > 0 (or None for `cliprange`), got {value}.")
    if args.cliprange_low is not None and not args.cliprange_low < 1:
        fail(
            f"`cliprange_low` must be < 1 (the ratio is clipped below at 1 - cliprange_low), got {args.cliprange_low}."
        )
    if args.dual_clip is not None and not args.dual_clip > 1:
        fail(
            f"`dual_clip` must be > 1 (it bounds the loss of a negative-advantage token at -A * dual_clip, a ratio "
            f"of dual_clip), got {args.dual_clip}."
        )
    if args.lam_value is not None and not 0.0 <= args.lam_value <= 1.0:
        fail(f"`lam_value` must be in [0, 1] (or None for `lam`), got {args.lam_value}.")
    if args.length_adaptive_lam_alpha is not None:
        if not args.length_adaptive_lam_alpha > 0:
            fail(f"`length_adaptive_lam_alpha` must be > 0 (or None), got {args.length_adaptive_lam_alpha}.")
        if args.lam_value is not None:
            fail(
                f"`length_adaptive_lam_alpha` ({args.length_adaptive_lam_alpha}) and `lam_value` ({args.lam_value}) "
                "are both set: with length-adaptive GAE the advantages' lambda comes from the response length and "
                "the returns use `lam` (VAPO: lam=1.0), so `lam_value` would have nothing to set. Drop one."
            )
    if args.truncated_episodes not in ("terminal", "bootstrap", "mask"):
        fail(f"Unknown `truncated_episodes` {args.truncated_episodes!r}: use 'terminal', 'bootstrap' or 'mask'.")
    if args.tool_chat_template is not None and args.tool_chat_template not in SHIPPED:
        fail(f"Unknown `tool_chat_template` {args.tool_chat_template!r}: use one of {sorted(SHIPPED)} (or None).")
    if args.kl_loss_estimator not in KL_ESTIMATORS:
        fail(f"Unknown `kl_loss_estimator` {args.kl_loss_estimator!r}: use 'k1', 'k2' or 'k3'.")
    if args.kl_loss_estimator != "k3" and args.kl_loss_coef == 0:
        fail(
            f"`kl_loss_estimator={args.kl_loss_estimator!r}` estimates the KL loss, which is off "
            "(`kl_loss_coef=0.0`): set `kl_loss_coef` > 0, or leave `kl_loss_estimator` at its default."
        )


# The options of the critic (GAE's value function) with their "off" values: a critic-free estimator refuses others.
CRITIC_OPTIONS = (
    ("critic_learning_rate", None),
    ("num_critic_epochs", 1),
    ("critic_warmup_steps", 0),
    ("critic_warmup_epochs", None),
    ("lam_value", None),
    ("length_adaptive_lam_alpha", None),
    ("value_head_init", "zeros"),
    ("save_value_model", False),
    ("whiten_rewards", False),
)


def _validate_estimator(args: PPOConfig) -> None:
    """`advantage_estimator`, `num_generations`, `scale_rewards` and `skip_zero_gradient_steps`, and the options a
    critic-free estimator has no use for."""
    estimator, generations = args.advantage_estimator, args.num_generations
    if estimator not in ESTIMATORS:
        fail(f"Unknown `advantage_estimator` {estimator!r}: use one of {', '.join(map(repr, ESTIMATORS))}.")
    if args.scale_rewards not in SCALE_REWARDS:
        fail(f"Unknown `scale_rewards` {args.scale_rewards!r}: use 'group' (GRPO) or 'none' (Dr. GRPO).")
    if args.scale_rewards != "group" and estimator != "grpo":
        fail(f"`scale_rewards={args.scale_rewards!r}` is an option of `advantage_estimator='grpo'`, not of "
             f"{estimator!r}: leave it at 'group'.")
    if generations < 1:
        fail(f"`num_generations` must be at least 1 (samples per prompt), got {generations}.")
    local = args.per_device_train_batch_size * args.gradient_accumulation_steps
    if local % generations:
        fail(f"Each process's batch must hold whole groups of `num_generations` ({generations}) samples of a prompt: "
             f"`per_device_train_batch_size * gradient_accumulation_steps` ({local}) is not a multiple of it.")
    if args.skip_zero_gradient_steps and args.fp16:
        fail("`skip_zero_gradient_steps` reads the gradient's norm before each step, and fp16's loss scaler steps on "
             "its own: use bf16 or float32, or leave the option off.")
    if uses_critic(estimator):
        return
    if generations < 2:
        fail(f"`advantage_estimator={estimator!r}` compares the samples of a prompt with each other: it needs "
             f"`num_generations` >= 2 (with 1, every advantage would be 0). Set `num_generations` (e.g. 4).")
    for name, off in CRITIC_OPTIONS:
        if getattr(args, name) != off:
            fail(f"`{name}={getattr(args, name)!r}` is an option of the critic, and `advantage_estimator="
                 f"{estimator!r}` has none (critic-free: {', '.join(CRITIC_FREE)}): leave `{name}` at {off!r}, or "
                 "use `advantage_estimator='gae'`.")
    if args.truncated_episodes == "bootstrap":
        fail(f"`truncated_episodes='bootstrap'` bootstraps from the critic's value, and `advantage_estimator="
             f"{estimator!r}` has no critic: use 'terminal' or 'mask'.")
    if args.gamma != 1.0:
        fail(f"`advantage_estimator={estimator!r}` scores whole episodes (gamma 1, as OpenRLHF's group estimators): "
             f"`gamma` must be 1.0, got {args.gamma}.")

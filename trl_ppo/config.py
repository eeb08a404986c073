"""Training configuration: `OnPolicyConfig` (any on-policy trainer) and `PPOConfig` (PPO's own knobs).

Field names, types and defaults follow the last TRL PPO trainer (trl 1.12), so that a TRL command line or a
`PPOConfig(...)` call keeps working after changing the import. The derived batch sizes are filled in by
`compute_batch_sizes`, called by the trainer once the number of processes is known.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from transformers import TrainingArguments
from transformers.utils import logging

logger = logging.get_logger(__name__)


@dataclass
class OnPolicyConfig(TrainingArguments):
    """Arguments shared by on-policy RL trainers (rollout, sampling, batch layout).

    Batch layout of one PPO update (`B` = `batch_size`, the number of episodes per update, over all processes):
    every process draws `local_batch_size = per_device_train_batch_size * gradient_accumulation_steps` prompts,
    samples one response each, then runs `num_ppo_epochs` passes over them in `num_mini_batches` minibatches of
    `local_mini_batch_size` episodes; each minibatch is split into micro-batches of `per_device_train_batch_size`
    whose gradients are accumulated into one optimizer step.
    """

    # Overridden TrainingArguments defaults (as in TRL's PPO config).
    learning_rate: float = field(default=3e-6, metadata={"help": "The initial learning rate for AdamW."})

    dataset_num_proc: int | None = field(
        default=None, metadata={"help": "Number of processes to use when tokenizing the dataset."}
    )
    num_mini_batches: int = field(
        default=1, metadata={"help": "Number of minibatches to split a batch into for each PPO epoch."}
    )
    total_episodes: int | None = field(
        default=None,
        metadata={
            "help": "Total number of episodes (prompt, response) to train on. Defaults to "
            "`num_train_epochs * len(train_dataset)`."
        },
    )
    local_rollout_forward_batch_size: int = field(
        default=64,
        metadata={"help": "Per-process chunk size for sampling and for the no-grad forward passes of a rollout."},
    )
    train_forward_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Episodes per forward/backward pass in the PPO update: a multiple of "
            "`per_device_train_batch_size` that divides the minibatch. The loss stays the mean over micro-batches of "
            "each micro-batch's loss, so the update is the same as with one micro-batch per pass; larger passes "
            "are faster where memory allows (on a GPU, often the whole minibatch). Default: "
            "`per_device_train_batch_size`."
        },
    )
    logprobs_chunk_size: int = field(
        default=1024,
        metadata={
            "help": "Response tokens per chunk when log-probabilities and entropies are computed from the policy's "
            "(and reference's) final hidden states: the LM head runs on one chunk at a time, and in the PPO update "
            "each chunk's logits are recomputed in the backward pass instead of stored, so the full [episodes, "
            "tokens, vocabulary] logits never exist at once. Same numbers as the plain forward. Taken for "
            "transformers' GPT-NeoX, GPT-2, Llama, Mistral, Mixtral, Qwen2/3 (MoE too), OLMo 2 and Phi-3 classes; "
            "other models are called whole. 0: always the plain forward with full logits."
        },
    )
    generation_backend: Literal["auto", "kv_cache", "compiled", "compiled_loop", "generate"] = field(
        default="auto",
        metadata={
            "help": "How responses are sampled. 'kv_cache': a plain sampling loop over the model's KV cache (any "
            "device). 'compiled': transformers' `generate` with a static KV cache, the decoding step compiled with "
            "CUDA graphs (on CUDA; the first rollouts pay the compilation). 'compiled_loop' (experimental): the same "
            "static cache and compiled step driven by trl_ppo's own loop instead of `generate`. 'generate': "
            "`generate` with its defaults. 'auto': 'compiled' on a CUDA device without DeepSpeed ZeRO-3 or PEFT, "
            "else 'kv_cache'. All sample from softmax(logits / temperature)."
        },
    )
    num_sample_generations: int = field(
        default=10,
        metadata={
            "help": "How many times during training to sample completions for a few evaluation prompts and show "
            "them in a table. 0 disables it."
        },
    )
    response_length: int = field(default=53, metadata={"help": "Number of tokens to sample for each response."})
    stop_token: Literal["eos"] | None = field(
        default=None,
        metadata={
            "help": "Stop token of the responses: 'eos' uses the tokenizer's EOS token. Everything after the stop "
            "token is replaced by padding. Mutually exclusive with `stop_token_id`."
        },
    )
    stop_token_id: int | None = field(
        default=None,
        metadata={"help": "Token id that ends a response. Mutually exclusive with `stop_token`."},
    )
    temperature: float = field(
        default=0.7,
        metadata={"help": "Sampling temperature; the same temperature divides the logits during training."},
    )
    missing_eos_penalty: float | None = field(
        default=None,
        metadata={
            "help": "Value subtracted from the score of a response that does not contain the stop token "
            "(`stop_token_id`, or EOS when `stop_token='eos'`). Encourages complete responses; must be positive."
        },
    )
    max_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "Cut prompts longer than this many tokens (keeping their end) and report how many were cut. "
            "Without it, a prompt that leaves no room for `response_length` in the model's context is an error."
        },
    )
    skip_nonfinite_updates: bool = field(
        default=False,
        metadata={
            "help": "On a non-finite (NaN/inf) loss, skip the rest of that update and count it "
            "(`loss/skipped_updates`) instead of stopping the run."
        },
    )
    sft_model_path: str = field(
        default="EleutherAI/pythia-160m", metadata={"help": "Path or hub name of the SFT model (used by scripts)."}
    )

    # Derived sizes: filled by the trainer (`compute_batch_sizes`); leave them unset.
    world_size: int | None = field(
        default=None, metadata={"help": "Number of processes (derived by the trainer; do not set)."}
    )
    num_total_batches: int | None = field(
        default=None, metadata={"help": "Number of PPO updates in the run (derived by the trainer; do not set)."}
    )
    micro_batch_size: int | None = field(
        default=None,
        metadata={"help": "`per_device_train_batch_size * world_size` (derived by the trainer; do not set)."},
    )
    local_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Episodes per process per update: `per_device_train_batch_size * gradient_accumulation_steps` "
            "(derived by the trainer; do not set)."
        },
    )
    batch_size: int | None = field(
        default=None,
        metadata={"help": "Episodes per update over all processes (derived by the trainer; do not set)."},
    )
    local_mini_batch_size: int | None = field(
        default=None, metadata={"help": "Episodes per minibatch per process (derived by the trainer; do not set)."}
    )
    mini_batch_size: int | None = field(
        default=None,
        metadata={"help": "Episodes per minibatch over all processes (derived by the trainer; do not set)."},
    )
    push_to_hub: bool = field(default=False, metadata={"help": "Whether to push the model to the Hub after training."})

    def __post_init__(self):
        # `--report_to wandb,tensorboard` (and a YAML list, passed that way) for several trackers at once.
        if isinstance(self.report_to, str) and "," in self.report_to:
            self.report_to = [name.strip() for name in self.report_to.split(",") if name.strip()]
        super().__post_init__()


@dataclass
class PPOConfig(OnPolicyConfig):
    """PPO hyper-parameters (defaults from the PPOv2 trainer and the "N implementation details of RLHF" report)."""

    exp_name: str = field(default="ppo_config", metadata={"help": "Name of this experiment."})
    reward_model_path: str = field(
        default="EleutherAI/pythia-160m", metadata={"help": "Path or hub name of the reward model (used by scripts)."}
    )
    model_adapter_name: str | None = field(
        default=None, metadata={"help": "With PEFT: name of the trained adapter (several adapters in one model)."}
    )
    ref_adapter_name: str | None = field(
        default=None,
        metadata={"help": "With PEFT: adapter to use as the reference policy; by default the adapter is disabled."},
    )
    num_ppo_epochs: int = field(default=4, metadata={"help": "Number of optimisation epochs over each rollout batch."})
    whiten_rewards: bool = field(
        default=False, metadata={"help": "Whiten (scale, no mean shift) the per-token rewards before GAE."}
    )
    kl_coef: float = field(default=0.05, metadata={"help": "KL penalty coefficient (beta)."})
    kl_estimator: Literal["k1", "k3"] = field(
        default="k1",
        metadata={
            "help": "Per-token KL estimator: 'k1' (log-ratio, unbiased) or 'k3' ((r - 1) - log r, unbiased and "
            "never negative). See http://joschu.net/blog/kl-approx.html."
        },
    )
    kl_target: float | None = field(
        default=None,
        metadata={
            "help": "Adaptive KL control (Ziegler et al. 2019): the per-sequence KL (`objective/kl`) to aim for. "
            "When set, the coefficient starts at `kl_coef` and after each update is multiplied by "
            "1 + clip(KL / kl_target - 1, -0.2, 0.2) * batch_size / kl_horizon. None keeps `kl_coef` fixed."
        },
    )
    kl_horizon: int = field(
        default=10000,
        metadata={"help": "Adaptive KL control: episodes over which the coefficient moves by the clipped error."},
    )
    reward_weights: list[float] | None = field(
        default=None,
        metadata={
            "help": "One weight per reward (in the order of `reward_model` when it is a list); the score is the "
            "weighted sum of the rewards. Defaults to 1.0 for each."
        },
    )
    kl_penalty: Literal["kl", "abs", "mse", "full"] = field(
        default="kl",
        metadata={
            "help": "Per-token KL penalty (from TRL's first PPOTrainer): 'kl' uses `kl_estimator` (k1 = log-ratio, "
            "or k3); 'abs' |log-ratio|; 'mse' 0.5 * log-ratio^2; 'full' the exact KL between the policy's and the "
            "reference's next-token distributions. With any value but 'kl', leave `kl_estimator` at 'k1'."
        },
    )
    use_score_scaling: bool = field(
        default=False,
        metadata={"help": "Divide scores by their running standard deviation (over all updates and processes)."},
    )
    use_score_norm: bool = field(
        default=False,
        metadata={"help": "With `use_score_scaling`: also subtract the running mean, giving scores of mean ~0."},
    )
    score_clip: float | None = field(
        default=None, metadata={"help": "Clip scores (after scaling) to [-score_clip, score_clip]. None: no clip."}
    )
    early_stopping: bool = field(
        default=False,
        metadata={
            "help": "Stop the rest of an update's PPO epochs and minibatches once a minibatch's mean approximate KL "
            "to the sampling policy (`policy/approxkl_avg`) exceeds 1.5 * `target_kl`; that minibatch takes no step."
        },
    )
    target_kl: float = field(default=1.0, metadata={"help": "With `early_stopping`: the KL that stops an update."})
    ratio_threshold: float | None = field(
        default=None,
        metadata={
            "help": "Skip (no optimizer step) a minibatch whose mean probability ratio exceeds this value, a guard "
            "against loss spikes; skips are counted in `policy/skipped_minibatches`. None: never skip."
        },
    )
    cliprange: float = field(default=0.2, metadata={"help": "Clip range of the policy probability ratio."})
    vf_coef: float = field(default=0.1, metadata={"help": "Value loss coefficient."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Clip range of the value function."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor."})
    lam: float = field(default=0.95, metadata={"help": "Lambda of generalized advantage estimation (GAE)."})
    ds3_gather_for_generation: bool = field(
        default=True,
        metadata={
            "help": "DeepSpeed ZeRO-3 only: gather the policy's weights once per rollout for fast sampling. "
            "Disable to train models that do not fit on one device (slower sampling)."
        },
    )
    save_value_model: bool = field(
        default=False,
        metadata={"help": "Also write the value model to `<output_dir>/value_model` in `save_model()`."},
    )


def _exact_div(numerator: int, denominator: int, what: str, numerator_name: str, denominator_name: str) -> int:
    if denominator <= 0 or numerator % denominator != 0:
        raise ValueError(
            f"{what}: `{numerator_name}` ({numerator}) must be a multiple of `{denominator_name}` ({denominator})."
        )
    return numerator // denominator


def compute_batch_sizes(args: OnPolicyConfig, world_size: int, train_dataset_len: int) -> None:
    """Fill the derived batch sizes of `args` in place, raising a clear error when a division is inexact."""
    if args.total_episodes is None:
        args.total_episodes = int(args.num_train_epochs * train_dataset_len)
    args.world_size = world_size
    args.local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps
    args.micro_batch_size = args.per_device_train_batch_size * world_size
    args.batch_size = args.local_batch_size * world_size
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
    # and a minibatch smaller than one micro-batch is one micro-batch); its loss is their losses' mean.
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


def stop_and_penalty_tokens(args: OnPolicyConfig, tokenizer) -> tuple[int | None, int | None]:
    """(the token that ends a response or None, the token whose absence `missing_eos_penalty` punishes: the stop
    token, else EOS as in TRL)."""
    stop_token_id = tokenizer.eos_token_id if args.stop_token == "eos" else args.stop_token_id
    if args.missing_eos_penalty is not None and stop_token_id is None:
        logger.warning(
            "`missing_eos_penalty` is set without a stop token: responses are not cut at EOS, and the penalty "
            "applies to those with no EOS anywhere. Set `stop_token='eos'` to end responses at EOS."
        )
    return stop_token_id, stop_token_id if stop_token_id is not None else tokenizer.eos_token_id


def fail(message: str) -> None:
    raise ValueError(message)


def validate_config(args: OnPolicyConfig) -> None:
    """Reject values that cannot work, before any model is touched. Each error names the argument and the fix."""
    if args.response_length < 1:
        fail(f"`response_length` must be at least 1, got {args.response_length}.")
    if not args.temperature > 0:
        fail(f"`temperature` must be > 0 (sampling divides logits by it), got {args.temperature}.")
    if args.stop_token not in (None, "eos"):
        fail(f"Unknown `stop_token` {args.stop_token!r}: use 'eos', or `stop_token_id` for another token.")
    if args.stop_token is not None and args.stop_token_id is not None:
        fail(f"`stop_token` ({args.stop_token!r}) and `stop_token_id` ({args.stop_token_id}) are both set: keep one.")
    if args.missing_eos_penalty is not None:
        if args.missing_eos_penalty < 0:
            fail(f"`missing_eos_penalty` is subtracted, so it must be >= 0; got {args.missing_eos_penalty}.")
    if args.generation_backend not in ("auto", "kv_cache", "compiled", "compiled_loop", "generate"):
        fail(
            f"Unknown `generation_backend` {args.generation_backend!r}: use 'auto', 'kv_cache', 'compiled', "
            "'compiled_loop' or 'generate'."
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
    if isinstance(args, PPOConfig):
        _validate_ppo_config(args)


def _validate_ppo_config(args: PPOConfig) -> None:
    """`validate_config`'s checks of PPO's own fields."""
    if args.kl_estimator not in ("k1", "k3"):
        fail(f"Unknown `kl_estimator` {args.kl_estimator!r}: use 'k1' or 'k3'.")
    if args.num_ppo_epochs < 1:
        fail(f"`num_ppo_epochs` must be at least 1, got {args.num_ppo_epochs}.")
    if args.kl_target is not None:
        if not args.kl_target > 0:
            fail(f"`kl_target` must be > 0 (or None to keep `kl_coef` fixed), got {args.kl_target}.")
        if not args.kl_coef > 0:
            fail(f"Adaptive KL control multiplies `kl_coef`, so it must be > 0 with `kl_target`, got {args.kl_coef}.")
    if args.kl_penalty not in ("kl", "abs", "mse", "full"):
        fail(f"Unknown `kl_penalty` {args.kl_penalty!r}: use 'kl', 'abs', 'mse' or 'full'.")
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
    if args.kl_horizon < 1:
        fail(f"`kl_horizon` must be at least 1, got {args.kl_horizon}.")
    for name in ("gamma", "lam"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            fail(f"`{name}` must be in [0, 1], got {getattr(args, name)}.")

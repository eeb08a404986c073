"""Training configuration: `OnPolicyConfig` (any on-policy trainer) and `PPOConfig` (PPO's own knobs).

Field names, types and defaults follow the last TRL PPO trainer (trl 1.12), so that a TRL command line or a
`PPOConfig(...)` call keeps working after changing the import. The derived batch sizes are filled in by
`config_checks.compute_batch_sizes`, called by the trainer once the number of processes is known; the
fields' values are checked by `config_checks.validate_config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from transformers import TrainingArguments

from .config_agents import AgentConfig
from .config_asynchronous import AsyncConfig
from .config_critic import CriticConfig
from .config_deadlines import DeadlineConfig
from .config_estimators import EstimatorConfig
from .config_fields import check_fields, check_interval_steps
from .config_vllm import VLLMConfig


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
            "`num_train_epochs * len(train_dataset)`; `max_steps` overrides it."
        },
    )
    max_steps: int = field(
        default=-1,
        metadata={
            "help": "If > 0: the number of PPO updates to run, each on `batch_size` episodes; overrides "
            "`total_episodes` (as in `transformers` it overrides `num_train_epochs`)."
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
            "`per_device_train_batch_size` that divides the minibatch. The minibatch's loss does not depend on how "
            "it is split into passes (or micro-batches), so the update is the same as with one micro-batch per "
            "pass; larger passes are faster where memory allows (on a GPU, often the whole minibatch). Default: "
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
    generation_backend: Literal["auto", "kv_cache", "compiled", "compiled_loop", "generate", "vllm"] = field(
        default="auto",
        metadata={
            "help": "How responses are sampled. 'kv_cache': a plain sampling loop over the model's KV cache (any "
            "device). 'compiled': transformers' `generate` with a static KV cache, the decoding step compiled with "
            "CUDA graphs (on CUDA; the first rollouts pay the compilation). 'compiled_loop' (experimental): the same "
            "static cache and compiled step driven by trl_ppo's own loop instead of `generate`. 'generate': "
            "`generate` with its defaults. 'auto': 'compiled' on a CUDA device without DeepSpeed ZeRO-3 or PEFT, "
            "else 'kv_cache'. 'vllm': a vLLM engine in the trainer's process samples the training rollouts and the "
            "episodes of tools and environments (the `vllm` extra; the policy's weights pushed to it once per update; "
            "the `vllm_*` fields); one-turn completion tables and `generate` run 'kv_cache'. All sample from "
            "softmax(logits / temperature)."
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
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start a fresh run in an `output_dir` holding an earlier run's checkpoints (deleted when the run "
            "starts) or, for `trl-ppo`, its saved model (replaced at the end). Ignored when resuming."
        },
    )

    def __post_init__(self):
        check_fields(self)  # types, finite numbers, bounds: before anything reads them
        check_interval_steps(self)  # before `TrainingArguments` reads an eval_steps of 0 as "unset"
        # `--report_to wandb,tensorboard` (and a YAML list, passed that way) for several trackers at once.
        if isinstance(self.report_to, str) and "," in self.report_to:
            self.report_to = [name.strip() for name in self.report_to.split(",") if name.strip()]
        super().__post_init__()


@dataclass
class PPOConfig(VLLMConfig, AsyncConfig, CriticConfig, AgentConfig, DeadlineConfig, EstimatorConfig, OnPolicyConfig):
    """PPO hyper-parameters (defaults from the PPOv2 trainer and the "N implementation details of RLHF" report), the
    advantage estimator with its samples per prompt (`EstimatorConfig`), the deadlines on calls into user code
    (`DeadlineConfig`), the shape of multi-turn episodes (`AgentConfig`), how the critic learns (`CriticConfig`),
    asynchronous sampling with its off-policy correction (`AsyncConfig`) and the vLLM engine (`VLLMConfig`)."""

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
    kl_estimator: Literal["k1", "k2", "k3"] = field(
        default="k1",
        metadata={
            "help": "Per-token KL estimator of the KL in the rewards, with r = pi_ref / pi: 'k1' (-log r, "
            "unbiased), 'k2' (0.5 * (log r)^2, biased, never negative) or 'k3' ((r - 1) - log r, unbiased and "
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
    kl_horizon: float = field(
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
    value_head_init: Literal["zeros", "normal"] = field(
        default="zeros",
        metadata={
            "help": "How the value head the trainer adds (`value_model=None`: a head on the policy's backbone) "
            "starts: 'zeros' (every value 0 until it learns, so the first advantages are the discounted scores) or "
            "'normal' (weights N(0, 1/(H+1)); on a pretrained model's large hidden states, per-token values of "
            "std ~1, noise that swamps scores of order 1). A head the model already has is kept."
        },
    )
    gamma: float = field(default=1.0, metadata={"help": "Discount factor."})
    lam: float = field(default=0.95, metadata={"help": "Lambda of generalized advantage estimation (GAE)."})
    gae_level: Literal["token", "turn"] = field(
        default="turn",
        metadata={
            "help": "Where GAE steps in multi-turn episodes (tools / environments, or `step()` masks with gaps): "
            "'turn' (Turn-PPO: each turn of the model a step, its value read at its first token, `gamma` and `lam` "
            "applied once per turn, its advantage on all its tokens; the default, as a tool call far from the "
            "reward then keeps its credit at `lam` 0.95) or 'token' (every model token a step, the default until "
            "2026-11-26). Episodes of one turn get the token-level numbers either way."
        },
    )

    # Options of large-scale RL systems (veRL, OpenRLHF, NeMo-RL, ROLL, slime); all off by default.
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        field(
            default="token-mean",
            metadata={
                "help": "How per-token losses (policy, value, entropy, KL loss) become one number: 'token-mean' "
                "(over all response tokens of the minibatch), 'seq-mean-token-mean' (mean per sequence, then over "
                "sequences), 'seq-mean-token-sum' (sum per sequence, mean over sequences) or "
                "'seq-mean-token-sum-norm' (sum per sequence / `response_length`, mean over sequences: no length "
                "bias, Dr. GRPO). Always normalised over the whole minibatch, so `gradient_accumulation_steps` "
                "does not change the update (veRL's `loss_agg_mode`)."
            },
        )
    )
    cliprange_low: float | None = field(
        default=None,
        metadata={
            "help": "Lower clip range of the probability ratio: clip(r, 1 - cliprange_low, 1 + cliprange_high). "
            "None: `cliprange`."
        },
    )
    cliprange_high: float | None = field(
        default=None,
        metadata={
            "help": "Upper clip range of the probability ratio; above `cliprange_low` it keeps low-probability "
            "tokens explorable ('clip-higher', DAPO uses 0.28 with 0.2 below). None: `cliprange`."
        },
    )
    dual_clip: float | None = field(
        default=None,
        metadata={
            "help": "Dual-clip PPO (Ye et al. 2020): the policy loss of a token with negative advantage A is at "
            "most -A * dual_clip (> 1, typically 3), so one far off-policy token cannot dominate "
            "(`policy/dual_clipfrac_avg`). None: off."
        },
    )
    entropy_coef: float = field(
        default=0.0,
        metadata={
            "help": "Entropy bonus: `entropy_coef * entropy` (aggregated as `loss_agg_mode`) is subtracted "
            "from the loss. 0: off."
        },
    )
    length_adaptive_lam_alpha: float | None = field(
        default=None,
        metadata={
            "help": "Length-adaptive GAE (VAPO): the advantages of a response of l tokens use lambda = 1 - 1 / "
            "(alpha * l) (at least 0), the returns `lam` (VAPO: alpha 0.05 with lam 1.0). None: off."
        },
    )
    kl_loss_coef: float = field(
        default=0.0,
        metadata={
            "help": "KL to the reference as a loss term (gradient through the policy's log-probs), estimated with "
            "`kl_loss_estimator`, beside or instead of the KL in the reward (`kl_coef=0.0` takes that out). "
            "0: off."
        },
    )
    kl_loss_estimator: Literal["k1", "k2", "k3"] = field(
        default="k3",
        metadata={
            "help": "Estimator of the KL loss: 'k1' (log-ratio), 'k2' (0.5 * log-ratio^2) or 'k3' (clamped for "
            "stability: log-ratio within +-20, estimate at most 10)."
        },
    )
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
    trajectory_dir: str | None = field(
        default=None,
        metadata={
            "help": "Folder where each update's episodes are appended as JSON lines, one file per process "
            "(`trajectories-<rank>.jsonl`: ids, model mask, turn starts, rewards, log-probs, values, advantages, "
            "returns, the text of each model turn, tool answer and token); `trl-ppo trajectories FILE` recomputes "
            "their advantages and losses without sampling, `trl-ppo trajectories view DIR` draws them as a web page. "
            "An update is written once applied; one a resume redoes is read from its last copy (each update once). "
            "None: off (nothing is computed)."
        },
    )

"""`PPOConfig` of TRL's first PPOTrainer (trl <= 0.11): every field with its name, type and default, its derived
sizes and its checks; and `core_config`, the `trl_ppo.PPOConfig` that runs it.

Batch layout in trl 0.11's words: each `step()` takes `batch_size` episodes (per process), optimises on them for
`ppo_epochs`, each epoch over shuffled groups of `backward_batch_size = mini_batch_size *
gradient_accumulation_steps` episodes (one optimizer step each), forwarded `mini_batch_size` at a time. In
`trl_ppo.PPOConfig`'s words that is `per_device_train_batch_size = mini_batch_size`, `num_mini_batches =
batch_size / backward_batch_size` and `gradient_accumulation_steps = batch_size / mini_batch_size`.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from dataclasses import asdict, dataclass, field
from typing import Literal

from ..compat import CHECKPOINTING_FIELD
from ..config import PPOConfig as CorePPOConfig
from ..config_fields import check_fields

# trl 0.11's names of the fields that `trl_ppo.PPOConfig` (and its checks) call otherwise.
RENAMED = {"kl_coef": "init_kl_coef", "kl_target": "target", "kl_horizon": "horizon"}


def _script_name() -> str:
    return os.path.splitext(os.path.basename(sys.argv[0]))[0] or "ppo"


@dataclass
class PPOConfig:
    """Configuration of `trl_ppo.legacy.PPOTrainer`, field for field trl 0.11.4's `PPOConfig`, plus two fields of
    trl_ppo's own: `output_dir` (where `save_checkpoint()` writes) and `critic_warmup_steps`.
    `HfArgumentParser(PPOConfig)` turns it into command-line flags."""

    exp_name: str = field(default_factory=_script_name, metadata={"help": "Name of this experiment."})
    seed: int = field(default=0, metadata={"help": "Random seed."})
    log_with: Literal["wandb", "tensorboard"] | None = field(
        default=None, metadata={"help": "Log `log_stats()` with 'wandb' or 'tensorboard'."}
    )
    task_name: str | None = field(default=None, metadata={"help": "Name of the task (for tracking only)."})
    model_name: str = field(default="gpt2", metadata={"help": "Name of the model (for tracking only)."})
    query_dataset: str = field(default="stanfordnlp/imdb", metadata={"help": "Name of the dataset (tracking only)."})
    reward_model: str = field(
        default="sentiment-analysis:lvwerra/distilbert-imdb", metadata={"help": "Reward model (tracking only)."}
    )
    remove_unused_columns: bool = field(
        default=True, metadata={"help": "Drop dataset columns the model does not read (except query/response/label)."}
    )
    tracker_kwargs: dict = field(
        default_factory=dict, metadata={"help": 'Tracker arguments, e.g. {"wandb": {"entity": ..., "name": ...}}.'}
    )
    accelerator_kwargs: dict = field(
        default_factory=dict, metadata={"help": 'Accelerator arguments; {"mixed_precision": "bf16"} is honoured.'}
    )
    project_kwargs: dict = field(
        default_factory=dict, metadata={"help": 'Project arguments; {"project_dir": ...} sets `output_dir`.'}
    )
    tracker_project_name: str = field(default="trl", metadata={"help": "Project name of the tracker."})
    push_to_hub_if_best_kwargs: dict = field(
        default_factory=dict, metadata={"help": "Not supported by trl_ppo (a warning says so); use save_pretrained."}
    )
    steps: int = field(default=20000, metadata={"help": "Number of training episodes (sets total_ppo_epochs)."})
    learning_rate: float = field(default=1.41e-5, metadata={"help": "Learning rate of the default Adam optimizer."})
    adap_kl_ctrl: bool = field(default=True, metadata={"help": "Adaptive KL control; otherwise a fixed coefficient."})
    init_kl_coef: float = field(default=0.2, metadata={"help": "Initial KL penalty coefficient."})
    kl_penalty: Literal["kl", "abs", "mse", "full"] = field(
        default="kl",
        metadata={"help": "'kl': log-ratio; 'abs': its absolute value; 'mse': half its square; 'full': exact KL."},
    )
    target: float = field(default=6.0, metadata={"help": "Target KL of adaptive KL control."})
    horizon: float = field(default=10000.0, metadata={"help": "Horizon of adaptive KL control, in episodes."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor of the advantages."})
    lam: float = field(default=0.95, metadata={"help": "Lambda of GAE."})
    cliprange: float = field(default=0.2, metadata={"help": "Clip range of the policy probability ratio."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Clip range of the values."})
    vf_coef: float = field(default=0.1, metadata={"help": "Value loss coefficient."})
    batch_size: int = field(default=128, metadata={"help": "Episodes per `step()` (per process)."})
    forward_batch_size: int | None = field(
        default=None, metadata={"help": "Deprecated: use `mini_batch_size`, which it overrides."}
    )
    mini_batch_size: int = field(default=128, metadata={"help": "Episodes per forward/backward pass."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Passes accumulated per optimizer step."})
    world_size: int | None = field(default=None, metadata={"help": "Number of processes (set by the trainer)."})
    ppo_epochs: int = field(default=4, metadata={"help": "Optimisation epochs over each batch."})
    max_grad_norm: float | None = field(default=None, metadata={"help": "Clip the gradient norm to this value."})
    optimize_cuda_cache: bool | None = field(
        default=None, metadata={"help": "Deprecated (no effect): trl_ppo frees memory itself."}
    )
    optimize_device_cache: bool = field(default=False, metadata={"help": "No effect: trl_ppo frees memory itself."})
    early_stopping: bool = field(default=False, metadata={"help": "Stop an update's epochs once the KL is too high."})
    target_kl: float = field(default=1.0, metadata={"help": "With `early_stopping`: stop above 1.5 * target_kl."})
    compare_steps: int = field(default=1, metadata={"help": "With `push_to_hub_if_best_kwargs` (not supported)."})
    ratio_threshold: float = field(
        default=10.0, metadata={"help": "Skip a minibatch whose mean probability ratio exceeds this (no step)."}
    )
    use_score_scaling: bool = field(default=False, metadata={"help": "Divide scores by their running std."})
    use_score_norm: bool = field(default=False, metadata={"help": "With score scaling, also subtract their mean."})
    score_clip: float | None = field(default=None, metadata={"help": "Clip scores to [-score_clip, score_clip]."})
    whiten_rewards: bool = field(default=False, metadata={"help": "Whiten the rewards (scale only) before GAE."})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Gradient checkpointing of the policy."})
    is_encoder_decoder: bool | None = field(default=None, metadata={"help": "Set by the trainer."})
    is_peft_model: bool | None = field(default=None, metadata={"help": "Set by the trainer."})
    backward_batch_size: int | None = field(
        default=None, metadata={"help": "Episodes per optimizer step: mini_batch_size * gradient_accumulation_steps."}
    )
    global_backward_batch_size: int | None = field(default=None, metadata={"help": "Over all processes."})
    global_batch_size: int | None = field(default=None, metadata={"help": "Over all processes."})
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes for dataset preprocessing."})
    output_dir: str = field(
        default="trl_ppo_legacy_output", metadata={"help": "trl_ppo: where `save_checkpoint()` writes checkpoints."}
    )
    critic_warmup_steps: int = field(
        default=0,
        metadata={
            "help": "trl_ppo: the first N `step()`s train only the value head (the policy, its backbone included, is "
            "left untouched), so that a new value head's first errors do not move the policy. 0 (trl 0.11): off."
        },
    )

    def __post_init__(self):
        check_fields(self, RENAMED)  # the core config's checks of types, finite numbers and bounds
        if self.optimize_cuda_cache is not None:
            warnings.warn(
                "`optimize_cuda_cache` is deprecated and has no effect in trl_ppo.", FutureWarning, stacklevel=3
            )
        if self.optimize_device_cache:
            warnings.warn("`optimize_device_cache` has no effect in trl_ppo.", UserWarning, stacklevel=3)
        if self.forward_batch_size is not None:
            warnings.warn(
                "`forward_batch_size` is deprecated: use `mini_batch_size`, which it now overrides.",
                FutureWarning,
                stacklevel=3,
            )
            self.mini_batch_size = self.forward_batch_size
        for name in ("batch_size", "mini_batch_size", "gradient_accumulation_steps", "ppo_epochs"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {getattr(self, name)!r}.")
        if self.kl_penalty not in ("kl", "abs", "mse", "full"):
            raise ValueError(f"`kl_penalty` must be 'kl', 'abs', 'mse' or 'full', got {self.kl_penalty!r}.")
        self.backward_batch_size = self.mini_batch_size * self.gradient_accumulation_steps
        if self.batch_size % self.backward_batch_size != 0:
            raise ValueError(
                f"`batch_size` ({self.batch_size}) must be a multiple of `mini_batch_size * "
                f"gradient_accumulation_steps` ({self.backward_batch_size})."
            )
        if self.log_with == "wandb":
            from transformers import is_wandb_available

            if not is_wandb_available():
                raise ImportError("`log_with='wandb'` needs wandb: `pip install wandb`.")
        self.total_ppo_epochs = int(math.ceil(self.steps / self.batch_size))
        if self.critic_warmup_steps >= max(self.total_ppo_epochs, 1):
            raise ValueError(
                f"`critic_warmup_steps` ({self.critic_warmup_steps}) must be smaller than the run's `step()`s, "
                f"ceil(steps / batch_size) = {max(self.total_ppo_epochs, 1)}: otherwise the policy never trains. "
                "Raise `steps` (episodes in all) or lower `critic_warmup_steps`."
            )

    def to_dict(self) -> dict:
        """The fields as one flat dict (nested dicts joined with '/'), as trl 0.11 logged them."""
        return _flatten(asdict(self))


def _flatten(values: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def core_config(config: PPOConfig, stop_token: str | None) -> CorePPOConfig:
    """The `trl_ppo.PPOConfig` that makes `trl_ppo.PPOTrainer.step()` do what trl 0.11's `step()` did with
    `config`. The learning rate stays constant unless a scheduler is given, as there; the trainer itself logs
    nothing (`log_stats()` does), saves only on `save_checkpoint()` and never evaluates."""
    precision = config.accelerator_kwargs.get("mixed_precision", "no")
    if precision not in ("no", "bf16", "fp16"):
        raise ValueError(f"`accelerator_kwargs['mixed_precision']` must be 'no', 'bf16' or 'fp16', got {precision!r}.")
    ignored = sorted(set(config.accelerator_kwargs) - {"mixed_precision"})
    if ignored:
        warnings.warn(f"`accelerator_kwargs` {ignored} are not applied by trl_ppo.", UserWarning, stacklevel=3)
    output_dir = config.project_kwargs.get("project_dir", config.output_dir)
    report_to = [config.log_with] if config.log_with else "none"
    return CorePPOConfig(
        output_dir=output_dir,
        run_name=config.tracker_kwargs.get("wandb", {}).get("name", config.exp_name),
        seed=config.seed,
        learning_rate=config.learning_rate,
        lr_scheduler_type="constant",
        per_device_train_batch_size=config.mini_batch_size,
        gradient_accumulation_steps=config.batch_size // config.mini_batch_size,
        num_mini_batches=config.batch_size // config.backward_batch_size,
        train_forward_batch_size=config.mini_batch_size,
        local_rollout_forward_batch_size=config.mini_batch_size,
        num_ppo_epochs=config.ppo_epochs,
        total_episodes=max(config.steps, config.batch_size),
        max_grad_norm=config.max_grad_norm or 0.0,
        kl_coef=config.init_kl_coef,
        kl_target=config.target if config.adap_kl_ctrl else None,
        kl_horizon=config.horizon,
        kl_penalty=config.kl_penalty,
        gamma=config.gamma,
        lam=config.lam,
        gae_level="token",  # trl 0.11 had no turns: its step() keeps the token-level GAE it has always had here
        cliprange=config.cliprange,
        cliprange_value=config.cliprange_value,
        vf_coef=config.vf_coef,
        whiten_rewards=config.whiten_rewards,
        use_score_scaling=config.use_score_scaling,
        use_score_norm=config.use_score_norm,
        score_clip=config.score_clip,
        early_stopping=config.early_stopping,
        target_kl=config.target_kl,
        ratio_threshold=config.ratio_threshold,
        critic_warmup_steps=config.critic_warmup_steps,
        **{CHECKPOINTING_FIELD: config.gradient_checkpointing},  # the old name warns in newer transformers
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        temperature=1.0,  # trl 0.11 scored the responses under the model's own (temperature 1) distribution
        stop_token=stop_token,
        response_length=20,  # `generate()`'s default length; `max_new_tokens` or a length sampler set it
        num_sample_generations=0,
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to=report_to,
        disable_tqdm=True,
        dataset_num_proc=config.dataset_num_proc,
    )

"""`PPOConfig`'s fields that choose the advantage estimator and how many samples each prompt gets, mixed into it
(`class PPOConfig(EstimatorConfig, OnPolicyConfig)`, so they follow `OnPolicyConfig`'s fields). Their checks are in
`config_checks.py`, the estimators in `estimators.py` (group) and `ppo.py` (GAE)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class EstimatorConfig:
    """`advantage_estimator`, `num_generations` and `scale_rewards` (OpenRLHF's and TRL GRPO's names), and
    `skip_zero_gradient_steps`, for the batches a group estimator finds no signal in."""

    advantage_estimator: Literal["gae", "grpo", "rloo", "reinforce_baseline"] = field(
        default="gae",
        metadata={
            "help": "How advantages are estimated (OpenRLHF's `--advantage_estimator`). 'gae' (the default): a critic "
            "(value model or value head) and GAE, per token or per turn (`gae_level`). Critic-free, over the "
            "`num_generations` samples of each prompt, one advantage per episode on all its model tokens, from its "
            "return R (score plus per-turn rewards): 'grpo' ((R - group mean) / (group std + 1e-4), as TRL GRPO; "
            "`scale_rewards='none'` is Dr. GRPO), 'rloo' (R minus the mean of the other samples' R, the summed KL "
            "penalty inside R) or 'reinforce_baseline' (REINFORCE++: R minus the group mean, then whitened over the "
            "batch). With 'grpo' and 'reinforce_baseline' the KL in the reward (`kl_coef`) is added per token as its "
            "sum to the episode's end; GRPO as published sets `kl_coef=0.0` and `kl_loss_coef` > 0 instead. "
            "Critic-free estimators build no value model or value head and run no value loss; they need "
            "`num_generations` >= 2 and `gamma` 1."
        },
    )
    num_generations: int = field(
        default=1,
        metadata={
            "help": "Samples per prompt, a group (TRL GRPO's name). Each prompt of a batch is repeated this many "
            "times, one after the other, and each process's batch holds whole groups, so "
            "`per_device_train_batch_size * gradient_accumulation_steps` must be a multiple of it. A batch then has "
            "`batch_size / num_generations` prompts, and an epoch of `train_dataset` is `num_generations * "
            "len(train_dataset)` episodes. At least 2 with a critic-free `advantage_estimator`; with 'gae' it only "
            "changes the sampling (VAPO's group sampling). `step()` reads each run of `num_generations` consecutive "
            "episodes as one group."
        },
    )
    scale_rewards: Literal["group", "none"] = field(
        default="group",
        metadata={
            "help": "How `advantage_estimator='grpo'` scales (TRL GRPO's name). 'group' divides each group's "
            "centred returns by the group's standard deviation (+1e-4), as GRPO does; 'none' does not (Dr. GRPO, Liu "
            "et al. 2025: the std favours prompts that are almost always or almost never solved)."
        },
    )
    skip_zero_gradient_steps: bool = field(
        default=False,
        metadata={
            "help": "Take no optimizer step when a minibatch's gradient is exactly zero everywhere, as it is with a "
            "critic-free `advantage_estimator` when every group's samples scored alike (and no KL, entropy or value "
            "term is left in the loss). AdamW would still move the weights by its momentum (about 0.9 of its last "
            "step, per weight); skipped, its state is left as it was. Counted per update in "
            "`policy/zero_gradient_steps`. Not under DeepSpeed or fp16 (their steps are taken before the norm is "
            "known)."
        },
    )

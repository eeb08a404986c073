"""`PPOConfig`'s fields that shape how the critic (GAE's value function) learns: its learning rate, its epochs, its
warm-up and the lambda of its targets, mixed into it like `EstimatorConfig` (so they follow `OnPolicyConfig`'s
fields). A critic-free `advantage_estimator` refuses them (`config_checks.CRITIC_OPTIONS`); the optimizer's groups
are `critic.py`'s, the epochs and the warm-up `update.py`'s, the targets `ppo.py`'s."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CriticConfig:
    """`critic_learning_rate`, `num_critic_epochs`, `critic_warmup_steps`, `critic_warmup_epochs` and `lam_value`."""

    critic_learning_rate: float | None = field(
        default=None,
        metadata={
            "help": "Learning rate of the value function's own parameters (logged as `lr_critic`). They get AdamW "
            "parameter groups of their own that follow the same `lr_scheduler_type` schedule, warm-up and decay "
            "scaled to this rate: a separate `value_model`'s parameters, or with `value_model=None` the value "
            "head's alone (the backbone it shares is the policy's, at `learning_rate`). reef gives a fresh critic "
            "5x the policy's rate. None: one rate for all (`learning_rate`)."
        },
    )
    num_critic_epochs: int = field(
        default=1,
        metadata={
            "help": "Epochs of the value function per PPO epoch. Each PPO epoch (policy and value) is followed by "
            "`num_critic_epochs - 1` value-only epochs over fresh minibatches, so the critic learns faster than "
            "the policy (Turn-PPO, SAO). 1: the value trains with the policy only."
        },
    )
    critic_warmup_steps: int = field(
        default=0,
        metadata={
            "help": "Value pretraining (VAPO): the first N updates train only the value function. They sample "
            "rollouts of the initial policy, whose weights and optimizer state are left untouched (with a value "
            "head on the policy's backbone, only the head trains: the backbone is the policy's), and run "
            "`critic_warmup_epochs` value-only epochs each, at `critic_learning_rate` when set. They count in the "
            "run's updates and schedule. 0: off."
        },
    )
    critic_warmup_epochs: int | None = field(
        default=None,
        metadata={
            "help": "Value-only epochs of each warm-up update (`critic_warmup_steps`). One optimizer step per "
            "minibatch: a fresh critic can need hundreds of steps before it reads what the prompt says "
            "about the return, and a normal update gives it `num_ppo_epochs * num_critic_epochs * "
            "num_mini_batches`: more epochs buy steps for the price of the updates' forward and backward passes, "
            "not of more rollouts. None: `num_ppo_epochs * num_critic_epochs`, as many as a normal update."
        },
    )
    lam_value: float | None = field(
        default=None,
        metadata={
            "help": "Decoupled GAE (VAPO): the lambda of the value targets (returns). `lam` stays the advantages' "
            "lambda. VAPO uses 1.0. None: `lam`."
        },
    )

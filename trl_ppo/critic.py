"""The critic's own optimisation, and a run watching it learn.

* `critic_learning_rate`: the value function's parameters (a separate value model's, or the value head's: a backbone
  shared with the policy is the policy's) in optimizer groups of their own at that rate (`split_critic_groups`),
  made by `CriticMethods.create_optimizer` from the groups `transformers.Trainer` builds (its weight-decay split
  kept). The schedule (`LambdaLR`) multiplies each group's own initial rate by the same factor, so both follow
  `lr_scheduler_type`, each from its own rate; `learning_rates` reads them for the log (`lr`, `lr_critic`).
* `value_pass_backward`: a value-only epoch's pass (`num_critic_epochs`, the warm-up's) through the value model
  alone, where nothing needs the policy to take part (`value_pass_possible`): the policy's terms are weighted 0
  there, so its forward and backward would only cost.
* `CriticWatch`: the warning, once per run, when the critic has explained (almost) nothing of the returns for many
  updates in a row (`low_ev_streak`, `ev_patience`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import logging

from . import losses
from .models import PreparedModels
from .rollout import Rollout, chunks

logger = logging.get_logger(__name__)

# Marks the optimizer groups of the critic's parameters (kept in the optimizer's state dict, so checkpoints too).
CRITIC_GROUP = "critic"
# The watch: an update whose critic explains at most this share of the returns' variance "explains nothing"...
EV_THRESHOLD = 0.05
# ... and this many such updates in a row (or a quarter of a shorter run, at least `MIN_EV_PATIENCE`) warn.
EV_PATIENCE, MIN_EV_PATIENCE = 20, 5
# What the watch reads from an update's metrics, and the first turn's, shown beside it in multi-turn runs.
EV_METRIC, FIRST_TURN_EV_METRIC = "val/explained_variance", "val/explained_variance/turn_1"


def critic_parameters(wrapper: nn.Module) -> list[nn.Parameter]:
    """The value function's own parameters in `wrapper` (a `PolicyAndValueWrapper`): all of a separate value
    model's, or a value head's; a backbone the head shares with the policy counts as the policy's."""
    policy = {id(parameter) for parameter in wrapper.lm.parameters()}
    return [parameter for parameter in wrapper.parameters() if id(parameter) not in policy]


def split_critic_groups(groups: list[dict], critic: set[int], critic_lr: float) -> list[dict]:
    """Each of an optimizer's `groups` (its `params` and their settings: weight decay, ...) as up to two groups with
    the same settings: its policy parameters, then its critic parameters (`critic`: their ids) at `critic_lr`, marked
    `CRITIC_GROUP`. A part without parameters is left out."""
    split = []
    for group in groups:
        policy = [parameter for parameter in group["params"] if id(parameter) not in critic]
        value = [parameter for parameter in group["params"] if id(parameter) in critic]
        split += [{**group, "params": policy}] if policy else []
        split += [{**group, "params": value, "lr": critic_lr, CRITIC_GROUP: True}] if value else []
    return split


def use_critic_learning_rate(optimizer: torch.optim.Optimizer, wrapper: nn.Module, critic_lr: float) -> None:
    """Regroup `optimizer` (built, never stepped: it has no state to move) so that the value function's parameters
    of `wrapper` train at `critic_lr`."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"`critic_learning_rate` needs a `torch.optim.Optimizer` with parameter groups, and `optim` made a "
            f"{type(optimizer).__name__}: use an AdamW `optim` (the default), or leave `critic_learning_rate` unset."
        )
    critic = {id(parameter) for parameter in critic_parameters(wrapper)}
    groups = split_critic_groups(optimizer.param_groups, critic, critic_lr)
    optimizer.param_groups.clear()
    for group in groups:
        optimizer.add_param_group(group)


class CriticMethods:
    """`PPOTrainer.create_optimizer`: `Trainer`'s, then the critic's parameters at `critic_learning_rate`."""

    def create_optimizer(self, model=None):
        rate = getattr(self.args, "critic_learning_rate", None)
        if rate is not None and self.optimizer is not None:
            raise ValueError(
                "`critic_learning_rate` is set and an optimizer was given (`optimizers=`): the given optimizer is "
                "used as it is, so the rate would be ignored. Put the value function's parameters in a group of "
                "their own in that optimizer instead, or let the trainer make it."
            )
        optimizer = super().create_optimizer(model)
        if rate is not None:
            use_critic_learning_rate(optimizer, self.model if model is None else model, rate)
        return optimizer


def learning_rates(scheduler) -> dict[str, float]:
    """The rates of the update, as the schedule set them: `lr` (the policy's) and `lr_critic`, or nothing when the
    critic has no groups of its own (`lr` is then the first group's, as before)."""
    rates = scheduler.get_last_lr()
    critic = [bool(group.get(CRITIC_GROUP)) for group in scheduler.optimizer.param_groups]
    if not any(critic):
        return {}
    policy = [rate for rate, is_critic in zip(rates, critic) if not is_critic]
    return {"lr": policy[0] if policy else 0.0, "lr_critic": rates[critic.index(True)]}


# ------------------------------------------------------------------------------------------- value-only passes
def value_pass_possible(models: PreparedModels) -> bool:
    """Whether a value-only epoch may run the value model alone: a separate value model, in one process without
    DeepSpeed or FSDP (there every trained parameter must take part in each backward)."""
    return (models.wrapper.value_model is not None and models.accelerator.num_processes == 1
            and not models.is_deepspeed and not models.is_fsdp2)  # fmt: skip


def value_pass_backward(
    episodes: Rollout, models: PreparedModels, args, aggregation: losses.LossAggregation, scale: int
) -> dict:
    """One pass of a value-only epoch: the value model's forward and `vf_coef` times the clipped value loss's
    backward (times `scale`), per micro-batch as `update.pass_backward` sums them. -> the value loss's stats
    (`loss/value_avg`, `val/clipfrac_avg`), lists per micro-batch."""
    episodes = episodes.trim_padding()
    with models.accelerator.autocast():
        values = models.wrapper.values(episodes.input_ids, episodes.attention_mask, episodes.responses.size(1))
    stats, loss = defaultdict(list), 0.0
    for part in chunks(episodes.queries.size(0), args.per_device_train_batch_size):
        value_loss, value_stats = value_terms(episodes.select(part), values[part], args, aggregation)
        for key, value in value_stats.items():
            stats[key].append(value)
        loss = loss + args.vf_coef * value_loss
    models.accelerator.backward(loss * scale)
    return stats


def value_terms(
    micro: Rollout, new_values: torch.Tensor, args, aggregation: losses.LossAggregation
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped value loss of a micro-batch (`new_values` `[b, T]`, reduced by the minibatch's `aggregation`:
    its share of the minibatch's loss) and its stats as the update reports them: `loss/value_avg` (as the
    micro-batch's own loss) and `val/clipfrac_avg`."""
    mask = micro.response_mask
    loss, stats = losses.value_loss(new_values, micro.values, micro.returns, mask, args.cliprange_value, aggregation)
    own = aggregation.normaliser / losses.aggregation_count(mask, aggregation.mode).clamp(min=1)
    return loss, {"loss/value_avg": loss.detach() * own, "val/clipfrac_avg": stats["clipfrac"]}


# ------------------------------------------------------------------------------------------- the watch
def ev_patience(num_updates: int) -> int:
    """The updates in a row of a critic that explains nothing before the warning: `EV_PATIENCE`, or a quarter of a
    shorter run (rounded up), at least `MIN_EV_PATIENCE` (a fresh critic explains nothing in its first updates)."""
    return max(MIN_EV_PATIENCE, min(EV_PATIENCE, math.ceil(num_updates / 4)))


def low_ev_streak(streak: int, explained_variance: float | None, threshold: float = EV_THRESHOLD) -> int:
    """The updates in a row whose critic explained at most `threshold` of the returns' variance, after one more
    update: one more when it did, 0 when it explained more; None (undefined: the returns were all equal) leaves the
    count as it was."""
    if explained_variance is None or math.isnan(explained_variance):
        return streak
    return streak + 1 if explained_variance <= threshold else 0


@dataclass
class CriticWatch:
    """The count of `low_ev_streak` over a run's updates, and whether the run has warned (once per run)."""

    streak: int = 0
    warned: bool = False

    def observe(self, metrics: dict[str, float], update: int, num_updates: int) -> str | None:
        """Count update `update`'s `val/explained_variance` (absent: no critic, or undefined) -> the warning, logged,
        when the streak has just reached `ev_patience(num_updates)` in a run that has not warned yet; else None."""
        self.streak = low_ev_streak(self.streak, metrics.get(EV_METRIC))
        if self.warned or self.streak < ev_patience(num_updates):
            return None
        self.warned = True
        first_turn = metrics.get(FIRST_TURN_EV_METRIC)
        turn = "" if first_turn is None else f"; the first turn's, {first_turn:.3g} at this update"
        message = (
            f"The critic has explained at most {EV_THRESHOLD:g} of the returns' variance (`{EV_METRIC}`) for "
            f"{self.streak} updates in a row (update {update} of {num_updates}{turn}): its values are about a "
            "constant, so GAE's advantages are those of a batch-mean baseline. To let it learn: "
            "`critic_learning_rate` (the value function's own rate, e.g. 5x `learning_rate`), `num_critic_epochs` "
            "(value-only epochs in every update), `critic_warmup_steps` (value pretraining on the initial policy's "
            "rollouts), `lam_value` (1.0: Monte-Carlo value targets), or a `value_model` initialised apart from "
            "the policy (a policy's features can ignore what the returns depend on). See docs/reference/metrics.md."
        )
        logger.warning(message)
        return message

    def state_dict(self) -> dict:
        return {"streak": self.streak, "warned": self.warned}

    def load_state_dict(self, state: dict) -> None:
        self.streak, self.warned = state["streak"], state["warned"]

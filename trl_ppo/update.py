"""The PPO update of one rollout: `num_ppo_epochs` × shuffled minibatches × micro-batches, one optimizer step
per minibatch, each minibatch judged by its guards first (non-finite loss, `ratio_threshold`, `early_stopping`,
then a non-finite gradient norm).
The losses themselves are in `losses.py`; `micro_batch_loss` composes them as the config asks.
"""

from __future__ import annotations

import contextlib
import enum
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers.utils import logging

from . import losses, ppo
from .critic import value_pass_backward, value_pass_possible, value_terms
from .models import PreparedModels
from .off_policy import behaviour_weights
from .rollout import Rollout, chunks, masked_response_logprobs

logger = logging.get_logger(__name__)


class Verdict(enum.Enum):
    """What to do with a minibatch whose gradients are ready."""

    STEP = "step"  # take the optimizer step
    SKIP = "skip"  # `ratio_threshold`: drop its gradients, go on with the next minibatch
    STOP = "stop"  # `early_stopping`: drop its gradients and end the update
    NONFINITE = "nonfinite"  # a non-finite loss or gradient norm: drop its gradients and its stats, end the update
    ZERO = "zero"  # `skip_zero_gradient_steps`: a gradient of exactly zero, no step (AdamW's momentum would move)

    @property
    def ends_update(self) -> bool:
        return self in (Verdict.STOP, Verdict.NONFINITE)


@dataclass
class UpdateResult:
    """What one PPO update did: per-micro-batch stats (each `[n]`), what non-finite value cut it short (None, or
    `NONFINITE_LOSS` / `NONFINITE_GRADIENT`), and with `detailed` stats the per-token ones (`policy/advantages`,
    `policy/ratio`: one 1-D tensor of the response tokens per micro-batch)."""

    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    nonfinite: str | None = None
    token_stats: dict[str, list[torch.Tensor]] = field(default_factory=dict)


# `detailed_stats` that hold one value per response token rather than one per micro-batch.
TOKEN_STATS = ("policy/advantages", "policy/ratio")
# The stats a value-only epoch (`num_critic_epochs`) reports: its policy terms are weighted 0.
VALUE_STATS = ("loss/value_avg", "val/clipfrac_avg")
# The whole loss of a micro-batch (policy, value, entropy and KL-loss terms), judged and not reported.
TOTAL_LOSS = "loss/total"
# The gradient's total norm before clipping, one value per optimizer step (`Trainer`'s and TRL GRPO's name).
GRAD_NORM = "grad_norm"
# What a non-finite update was cut short by, in messages.
NONFINITE_LOSS, NONFINITE_GRADIENT = "PPO loss", "gradient norm"


def ppo_update(
    rollout: Rollout,
    advantages: ppo.Advantages,
    models: PreparedModels,
    optimizer,
    args,
    update: int,
    detailed: bool = False,
) -> UpdateResult:
    """Optimise the policy and value function on one rollout (`update` is its number, for messages).

    Stats are those of the minibatches whose losses were finite; with `early_stopping` / `ratio_threshold`
    (and no non-finite loss) also `policy/early_stop_frac` (minibatches stepped / planned) and
    `policy/skipped_minibatches`; `grad_norm` is the gradient norm before clipping, one per step of the PPO epochs
    (none under DeepSpeed or fp16's loss scaler, which clip inside). `detailed` adds the stats of TRL's first
    PPOTrainer (`detailed_stats`). The first `critic_warmup_steps` updates train only the value function (for
    `critic_warmup_epochs` epochs, `epoch_plan`), and with `num_critic_epochs` > 1 each PPO epoch is followed by
    value-only epochs (their stats: the value loss's alone, `VALUE_STATS`)."""
    episodes = rollout.with_advantages(advantages)
    stats, counts, nonfinite = defaultdict(list), {verdict: 0 for verdict in Verdict}, None
    warmup = update <= args.critic_warmup_steps
    models.model.train()
    for minibatch, value_epoch in shuffled_minibatches(args, episodes.queries.device, warmup):
        critic_only = warmup or value_epoch
        value_only = value_epoch and value_pass_possible(models)  # the value model alone: the policy weighs 0
        minibatch_stats = minibatch_backward(episodes, minibatch, models, args, detailed, critic_only, value_only)
        verdict = judge_minibatch(minibatch_stats, models.accelerator, args, update)
        minibatch_stats.pop(TOTAL_LOSS, None)
        nonfinite = NONFINITE_LOSS if verdict is Verdict.NONFINITE else None
        if critic_only:  # no gradient, so AdamW leaves the policy's weights and its state alone
            for parameter in models.wrapper.lm.parameters():
                parameter.grad = None
        norm = gradient_norm(models, args) if verdict is Verdict.STEP else None
        if norm is not None and not all_finite(norm.reshape(1), models.accelerator):
            verdict, nonfinite = Verdict.NONFINITE, NONFINITE_GRADIENT
        elif norm is not None and args.skip_zero_gradient_steps and norm.item() == 0.0:
            verdict = Verdict.ZERO  # the norm is the same on every process: they all skip
        if verdict is Verdict.STEP:
            optimizer.step()
        optimizer.zero_grad()
        counts[verdict] += not value_epoch
        if verdict is not Verdict.NONFINITE:
            for key, values in minibatch_stats.items():
                if not value_epoch or key in VALUE_STATS:  # the policy's stats of a value epoch would count twice
                    stats[key].extend(values)
            if norm is not None and not value_epoch:
                stats[GRAD_NORM].append(norm.detach().reshape(()))
        if verdict.ends_update:
            break
    token_stats = {key: stats.pop(key) for key in TOKEN_STATS if key in stats}
    per_micro_batch = {key: torch.stack(values) for key, values in stats.items()}
    result = UpdateResult(per_micro_batch, nonfinite, token_stats)
    if not result.nonfinite:  # a cut-short update reports only its losses' stats
        device = episodes.queries.device
        if args.early_stopping:
            planned = epoch_plan(args, warmup).count(False) * args.num_mini_batches
            result.stats["policy/early_stop_frac"] = torch.tensor([counts[Verdict.STEP] / planned], device=device)
        if args.ratio_threshold is not None:
            result.stats["policy/skipped_minibatches"] = torch.tensor([float(counts[Verdict.SKIP])], device=device)
        if args.skip_zero_gradient_steps:
            result.stats["policy/zero_gradient_steps"] = torch.tensor([float(counts[Verdict.ZERO])], device=device)
    return result


def gradient_norm(models: PreparedModels, args) -> torch.Tensor | None:
    """Clip the gradients to `max_grad_norm` (0: no clipping) -> their total norm before clipping (0-d; the same on
    every process once gradients are synchronised), or None under DeepSpeed (its engine clips and has stepped
    already) and with fp16's loss scaler, which skips a step with an infinite gradient itself and lowers its scale:
    that is how it calibrates."""
    accelerator = models.accelerator
    if models.is_deepspeed or getattr(accelerator, "scaler", None) is not None:
        if args.max_grad_norm:
            accelerator.clip_grad_norm_(models.model.parameters(), args.max_grad_norm)
        return None
    max_norm = args.max_grad_norm if args.max_grad_norm > 0 else float("inf")  # inf: the norm, nothing clipped
    norm = accelerator.clip_grad_norm_(models.model.parameters(), max_norm)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor over the shards
    return torch.as_tensor(norm)


def all_finite(values: torch.Tensor, accelerator) -> bool:
    """Whether every one of `values` is finite on every process (all processes get the same answer)."""
    finite = torch.isfinite(values).all().float().reshape(1)
    return accelerator.reduce(finite, reduction="sum").item() == accelerator.num_processes


def epoch_plan(args, warmup: bool = False) -> list[bool]:
    """Whether each epoch of an update is value-only: `num_ppo_epochs` PPO epochs, each followed by
    `num_critic_epochs - 1` value-only ones; in a warm-up update with `critic_warmup_epochs`, that many epochs, the
    first counted as the PPO epoch (its policy stats reported; like every warm-up epoch, it trains the value alone)."""
    warmup_epochs = getattr(args, "critic_warmup_epochs", None) if warmup else None
    if warmup_epochs is not None:
        return [False] + [True] * (warmup_epochs - 1)
    return ([False] + [True] * (getattr(args, "num_critic_epochs", 1) - 1)) * args.num_ppo_epochs


def shuffled_minibatches(args, device: torch.device, warmup: bool = False) -> Iterator[tuple[torch.Tensor, bool]]:
    """(episode indices of each minibatch, whether it is a value-only epoch's) for each epoch of `epoch_plan`, each
    over a fresh permutation of this process's `local_batch_size` episodes (drawn when its epoch begins)."""
    for value_epoch in epoch_plan(args, warmup):
        for minibatch in torch.randperm(args.local_batch_size, device=device).split(args.local_mini_batch_size):
            yield minibatch, value_epoch


def minibatch_backward(
    episodes: Rollout,
    minibatch: torch.Tensor,
    models: PreparedModels,
    args,
    detailed: bool = False,
    critic_only: bool = False,
    value_only: bool = False,
) -> dict:
    """Forward and backward over one minibatch in passes of `train_forward_batch_size` episodes, gradients
    accumulated into the gradient of the minibatch's loss (aggregated over the whole minibatch on all processes,
    `loss_agg_mode`); -> its stats, per micro-batch (each a list of 0-d tensors). `value_only`: passes of the value
    model alone (`critic.value_pass_backward`)."""
    passes = minibatch.split(args.train_forward_batch_size)  # whole micro-batches each
    aggregation = minibatch_aggregation(episodes.response_mask[minibatch], models.accelerator, args)
    scale = backward_scale(models.accelerator.num_processes, len(passes), models.is_deepspeed)
    minibatch_stats = defaultdict(list)
    for i, index in enumerate(passes):
        with gradient_sync(models, last=i == len(passes) - 1):
            if value_only:
                pass_stats = value_pass_backward(episodes.select(index), models, args, aggregation, scale)
            else:
                pass_stats = pass_backward(episodes.select(index), models, args, aggregation, scale, detailed,
                                           critic_only)  # fmt: skip
        for key, values in pass_stats.items():
            minibatch_stats[key].extend(values)
    return minibatch_stats


def minibatch_aggregation(response_mask: torch.Tensor, accelerator, args) -> losses.LossAggregation:
    """`loss_agg_mode` with the count of the minibatch `[b, T]` summed over all processes as its normaliser, so
    that the losses of all its micro-batches, on all processes, add up to the minibatch's loss."""
    count = losses.aggregation_count(response_mask, args.loss_agg_mode).reshape(1)
    count = accelerator.reduce(count, reduction="sum").reshape(())
    return losses.LossAggregation(args.loss_agg_mode, count, args.response_length)


def backward_scale(num_processes: int, passes: int, deepspeed: bool) -> int:
    """What a pass's loss is multiplied by before its backward, so that the optimizer step follows the gradient of
    the minibatch's loss: the gradients are averaged over processes (DDP and DeepSpeed), and DeepSpeed also
    divides by its `gradient_accumulation_steps` (= passes per minibatch, `distributed.fit_deepspeed_batch_layout`).
    Accelerate adds no division of its own (`accelerator.gradient_accumulation_steps` is 1: `OnPolicyTrainer`)."""
    return num_processes * (passes if deepspeed else 1)


def gradient_sync(models: PreparedModels, last: bool):
    """The context of one pass's backward: gradients are synchronised over processes (and, under DeepSpeed, the
    optimizer steps) only after the minibatch's `last` pass."""
    if models.is_deepspeed:
        # DeepSpeed reads the boundary from accelerate's flag (`Trainer` keeps accelerate's own accumulation off).
        models.accelerator.gradient_state._set_sync_gradients(last)
        return contextlib.nullcontext()
    if models.is_fsdp2:  # each pass reduce-scatters into the sharded gradients: deferring that would hold them whole
        return contextlib.nullcontext()
    return contextlib.nullcontext() if last else models.accelerator.no_sync(models.model)


def pass_backward(
    episodes: Rollout,
    models: PreparedModels,
    args,
    aggregation: losses.LossAggregation,
    scale: int,
    detailed: bool = False,
    critic_only: bool = False,
) -> dict:
    """One forward/backward over whole micro-batches (`train_forward_batch_size` episodes), without the padding
    columns common to all of them; the loss is the sum of the micro-batches' `micro_batch_loss`, times `scale`
    (`backward_scale`). -> per-micro-batch stats (lists)."""
    episodes = episodes.trim_padding()
    with models.accelerator.autocast():
        output = models.model(
            episodes.input_ids,
            episodes.attention_mask,
            episodes.responses,
            args.temperature,
            args.logprobs_chunk_size,
            entropy=True,
            entropy_grad=args.entropy_coef > 0,
        )
    new_logprobs = masked_response_logprobs(output.logprobs, episodes)
    stats, loss = defaultdict(list), 0.0
    for part in chunks(episodes.queries.size(0), args.per_device_train_batch_size):
        micro = episodes.select(part)
        new = (new_logprobs[part], None if output.values is None else output.values[part], output.entropy[part])
        micro_loss, micro_stats = micro_batch_loss(micro, *new, args, aggregation, critic_only)
        loss = loss + micro_loss
        for key, value in micro_stats.items():
            stats[key].append(value)
        if detailed:
            for key, value in detailed_stats(micro, new_logprobs[part], output.values[part]).items():
                stats[key].append(value)
    models.accelerator.backward(loss * scale)
    return stats


def correction_weights(micro: Rollout, args) -> torch.Tensor | None:
    """`off_policy_correction`'s weights `[b, T]` of the micro-batch's tokens (`off_policy.behaviour_weights`: its
    `logprobs` are the proximal policy's, `sampler_logprobs` the behaviour policy's); None without a correction or
    without the sampler's log-probs. (Their stats are the rollout's, `offpolicy/*`: the same every epoch.)"""
    correction = getattr(args, "off_policy_correction", None)
    if correction is None or micro.sampler_logprobs is None:
        return None
    return behaviour_weights(micro.logprobs, micro.sampler_logprobs, micro.response_mask, correction, args.tis_cap)[0]


def micro_batch_loss(
    micro: Rollout,
    new_logprobs: torch.Tensor,
    new_values: torch.Tensor,
    entropy: torch.Tensor,
    args,
    aggregation: losses.LossAggregation,
    critic_only: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's loss on one micro-batch as the config composes it: the clipped policy loss (clip-higher, dual-clip),
    the entropy bonus and the KL loss (kept in the graph but weighted 0 while `critic_only`), plus `vf_coef` times
    the clipped value loss (none without a critic: `new_values` None), each reduced by `aggregation`.
    new_logprobs, new_values, entropy `[b, T]`: the update's forward. -> (its share of the minibatch's loss, its
    stats: 0-d tensors, losses as this micro-batch's own)."""
    mask = micro.response_mask
    low, high = clipranges(args)
    weights = correction_weights(micro, args)
    pg_loss, pg_stats = losses.policy_loss(
        new_logprobs, micro.logprobs, micro.advantages, mask, low, high, args.dual_clip, aggregation, weights
    )
    own = aggregation.normaliser / losses.aggregation_count(mask, aggregation.mode).clamp(min=1)
    stats = {
        "policy/approxkl_avg": pg_stats["approxkl"],
        "policy/clipfrac_avg": pg_stats["clipfrac"],
        "loss/policy_avg": pg_loss.detach() * own,
    }
    vf_loss = 0.0
    if new_values is not None:
        vf_loss, value_stats = value_terms(micro, new_values, args, aggregation)
        stats |= value_stats
    stats |= {"policy/entropy_avg": ppo.masked_mean(entropy.detach(), mask), "val/ratio": pg_stats["ratio"]}
    for name in ("clipfrac_low", "clipfrac_high", "dual_clipfrac"):
        if name in pg_stats:
            stats[f"policy/{name}_avg"] = pg_stats[name]
    policy_terms = pg_loss
    if args.entropy_coef > 0:
        entropy_term, _ = losses.entropy_loss(entropy, mask, aggregation)
        policy_terms = policy_terms + args.entropy_coef * entropy_term
    if args.kl_loss_coef > 0:
        kl_term, _ = losses.kl_loss(new_logprobs, micro.ref_logprobs, mask, args.kl_loss_estimator, aggregation)
        policy_terms = policy_terms + args.kl_loss_coef * kl_term
        stats["loss/kl_avg"] = kl_term.detach() * own
    if critic_only:  # in the graph, so that every parameter still gets a gradient (as DDP requires)
        policy_terms = policy_terms * 0.0
    total = policy_terms + args.vf_coef * vf_loss
    stats[TOTAL_LOSS] = total.detach()
    return total, stats


def clipranges(args) -> tuple[float, float | None]:
    """(the ratio's lower clip range, its upper one or None when symmetric) from `cliprange`, `cliprange_low`
    and `cliprange_high`."""
    if args.cliprange_low is None and args.cliprange_high is None:
        return args.cliprange, None
    low = args.cliprange if args.cliprange_low is None else args.cliprange_low
    return low, args.cliprange if args.cliprange_high is None else args.cliprange_high


@torch.no_grad()
def detailed_stats(micro: Rollout, new_logprobs: torch.Tensor, new_values: torch.Tensor) -> dict:
    """The further stats of one micro-batch that TRL's first PPOTrainer reported (named as there, without its
    `ppo/` prefix), computed only when asked for: 0-d tensors, and the advantages and ratios of its response
    tokens (1-D, `TOKEN_STATS`). new_logprobs, new_values `[b, T]`: the update's forward."""
    mask = micro.response_mask
    log_ratio = new_logprobs - micro.logprobs
    stats = {
        "policy/policykl": ppo.masked_mean(-log_ratio, mask),
        "policy/advantages_mean": ppo.masked_mean(micro.advantages, mask),
    }
    if new_values is not None:  # without a critic, no value statistics of nothing
        stats |= {
            "val/vpred": ppo.masked_mean(new_values, mask),
            "val/error": ppo.masked_mean((new_values - micro.returns) ** 2, mask),
            "returns/mean": ppo.masked_mean(micro.returns, mask),
            "returns/var": ppo.masked_var(micro.returns, mask),
            "val/mean": ppo.masked_mean(micro.values, mask),
            "val/var": ppo.masked_var(micro.values, mask),
        }
    return stats | {
        "policy/advantages": micro.advantages[mask].float(),
        "policy/ratio": torch.exp(log_ratio)[mask].float(),
    }


def judge_minibatch(minibatch_stats: dict, accelerator, args, update: int) -> Verdict:
    """The minibatch's verdict, from values reduced over all processes so that every process decides the same:
    NONFINITE when a loss (the policy's, the value's or the total) is NaN/inf, SKIP when its mean ratio exceeds
    `ratio_threshold`, STOP when its mean approximate KL exceeds 1.5 * `target_kl` (`early_stopping`), else STEP
    (a pass of the value model alone has no ratio: it is judged by its loss only)."""
    names = ("loss/policy_avg", "loss/value_avg", TOTAL_LOSS)
    if not all_finite(torch.stack([v for name in names for v in minibatch_stats.get(name, [])]), accelerator):
        return Verdict.NONFINITE
    if args.ratio_threshold is not None and "val/ratio" in minibatch_stats:  # none in a pass of the value alone
        ratio = accelerator.reduce(torch.stack(minibatch_stats["val/ratio"]).mean().reshape(1), "mean").item()
        if ratio > args.ratio_threshold:
            logger.warning(
                f"A minibatch of update {update} has a mean probability ratio of {ratio:.3g} > ratio_threshold "
                f"({args.ratio_threshold}): skipped."
            )
            return Verdict.SKIP
    if args.early_stopping and "policy/approxkl_avg" in minibatch_stats:
        approxkl = torch.stack(minibatch_stats["policy/approxkl_avg"]).mean().reshape(1)
        if accelerator.reduce(approxkl, "mean").item() > 1.5 * args.target_kl:
            return Verdict.STOP
    return Verdict.STEP


def nonfinite_error(
    update: int, deepspeed: bool, last_checkpoint: str | None, what: str = NONFINITE_LOSS
) -> FloatingPointError:
    """The error that stops a run at a non-finite loss or gradient norm (`what`; without `skip_nonfinite_updates`)."""
    step = "DeepSpeed has already stepped with it" if deepspeed else "no optimizer step was taken"
    return FloatingPointError(
        f"Non-finite {what} at update {update}; {step}. Last complete checkpoint: {last_checkpoint or 'none'}. "
        "Lower `learning_rate`, check the reward scale and the loss coefficients (`vf_coef`, `entropy_coef`, "
        "`kl_loss_coef`), or set `skip_nonfinite_updates=True` to skip such updates."
    )

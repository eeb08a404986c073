"""The PPO update of one rollout: `num_ppo_epochs` × shuffled minibatches × micro-batches, one optimizer step
per minibatch, each minibatch judged by its guards first (non-finite loss, `ratio_threshold`, `early_stopping`).
The losses themselves are in `ppo.py`.
"""

from __future__ import annotations

import contextlib
import enum
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers.utils import logging

from . import ppo
from .models import PreparedModels
from .rollout import Rollout, chunks, masked_response_logprobs

logger = logging.get_logger(__name__)


class Verdict(enum.Enum):
    """What to do with a minibatch whose gradients are ready."""

    STEP = "step"  # take the optimizer step
    SKIP = "skip"  # `ratio_threshold`: drop its gradients, go on with the next minibatch
    STOP = "stop"  # `early_stopping`: drop its gradients and end the update
    NONFINITE = "nonfinite"  # a non-finite loss: drop its gradients and its stats, end the update

    @property
    def ends_update(self) -> bool:
        return self in (Verdict.STOP, Verdict.NONFINITE)


@dataclass
class UpdateResult:
    """What one PPO update did: per-micro-batch stats (each `[n]`), whether a non-finite loss cut it short, and
    with `detailed` stats the per-token ones (`policy/advantages`, `policy/ratio`: one 1-D tensor of the
    response tokens per micro-batch)."""

    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    nonfinite: bool = False
    token_stats: dict[str, list[torch.Tensor]] = field(default_factory=dict)


# `detailed_stats` that hold one value per response token rather than one per micro-batch.
TOKEN_STATS = ("policy/advantages", "policy/ratio")


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
    `policy/skipped_minibatches`. `detailed` adds the stats of TRL's first PPOTrainer (`detailed_stats`)."""
    episodes = rollout.with_advantages(advantages)
    stats, counts = defaultdict(list), {verdict: 0 for verdict in Verdict}
    models.model.train()
    for minibatch in shuffled_minibatches(args, episodes.queries.device):
        minibatch_stats = minibatch_backward(episodes, minibatch, models, args, detailed)
        verdict = judge_minibatch(minibatch_stats, models.accelerator, args, update)
        if verdict is Verdict.STEP:
            if args.max_grad_norm:
                models.accelerator.clip_grad_norm_(models.model.parameters(), args.max_grad_norm)
            optimizer.step()
        optimizer.zero_grad()
        counts[verdict] += 1
        if verdict is not Verdict.NONFINITE:
            for key, values in minibatch_stats.items():
                stats[key].extend(values)
        if verdict.ends_update:
            break
    token_stats = {key: stats.pop(key) for key in TOKEN_STATS if key in stats}
    per_micro_batch = {key: torch.stack(values) for key, values in stats.items()}
    result = UpdateResult(per_micro_batch, counts[Verdict.NONFINITE] > 0, token_stats)
    if not result.nonfinite:  # a cut-short update reports only its losses' stats
        device = episodes.queries.device
        if args.early_stopping:
            planned = args.num_ppo_epochs * args.num_mini_batches
            result.stats["policy/early_stop_frac"] = torch.tensor([counts[Verdict.STEP] / planned], device=device)
        if args.ratio_threshold is not None:
            result.stats["policy/skipped_minibatches"] = torch.tensor([float(counts[Verdict.SKIP])], device=device)
    return result


def shuffled_minibatches(args, device: torch.device) -> Iterator[torch.Tensor]:
    """Episode indices of each minibatch, `num_ppo_epochs` times over a fresh permutation of this process's
    `local_batch_size` episodes (drawn when its epoch begins)."""
    for _ in range(args.num_ppo_epochs):
        yield from torch.randperm(args.local_batch_size, device=device).split(args.local_mini_batch_size)


def minibatch_backward(
    episodes: Rollout, minibatch: torch.Tensor, models: PreparedModels, args, detailed: bool = False
) -> dict:
    """Forward and backward over one minibatch in passes of `train_forward_batch_size` episodes, gradients
    accumulated; -> its stats, per micro-batch (each a list of 0-d tensors)."""
    passes = minibatch.split(args.train_forward_batch_size)  # whole micro-batches each
    micro_batches = len(minibatch.split(args.per_device_train_batch_size))
    minibatch_stats = defaultdict(list)
    for i, index in enumerate(passes):
        with gradient_sync(models, last=i == len(passes) - 1):
            pass_stats = pass_backward(episodes.select(index), models, args, micro_batches, detailed)
        for key, values in pass_stats.items():
            minibatch_stats[key].extend(values)
    return minibatch_stats


def gradient_sync(models: PreparedModels, last: bool):
    """The context of one pass's backward: gradients are synchronised over processes (and, under DeepSpeed, the
    optimizer steps) only after the minibatch's `last` pass."""
    if models.is_deepspeed:
        # DeepSpeed reads the boundary from accelerate's flag (`Trainer` keeps accelerate's own accumulation off).
        models.accelerator.gradient_state._set_sync_gradients(last)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if last else models.accelerator.no_sync(models.model)


def loss_divisor(micro_batches_in_pass: int, micro_batches_in_minibatch: int, deepspeed: bool) -> int:
    """What a pass's summed micro-batch losses are divided by, so that the optimizer step follows the mean of the
    minibatch's micro-batch losses whatever the passes: the minibatch's micro-batch count, or under DeepSpeed,
    which itself divides by its `gradient_accumulation_steps` (= passes per minibatch,
    `distributed.fit_deepspeed_batch_layout`), the pass's. Accelerate adds no division of its own
    (`accelerator.gradient_accumulation_steps` is 1: `OnPolicyTrainer` sets it)."""
    return micro_batches_in_pass if deepspeed else micro_batches_in_minibatch


def pass_backward(
    episodes: Rollout, models: PreparedModels, args, micro_batches_in_minibatch: int, detailed: bool = False
) -> dict:
    """One forward/backward over whole micro-batches (`train_forward_batch_size` episodes), without the padding
    columns common to all of them. The loss is computed per micro-batch (masked means over its tokens) and
    summed, so the gradient equals that of one pass per micro-batch. -> per-micro-batch stats (lists)."""
    episodes = episodes.trim_padding()
    with models.accelerator.autocast():
        output = models.model(
            episodes.input_ids,
            episodes.attention_mask,
            episodes.responses,
            args.temperature,
            args.logprobs_chunk_size,
            entropy=True,
        )
    new_logprobs = masked_response_logprobs(output.logprobs, episodes)
    stats, loss = defaultdict(list), 0.0
    for part in chunks(episodes.queries.size(0), args.per_device_train_batch_size):
        micro = episodes.select(part)
        mask = micro.response_mask
        pg_loss, pg_stats = ppo.policy_loss(new_logprobs[part], micro.logprobs, micro.advantages, mask, args.cliprange)
        vf_loss, vf_stats = ppo.value_loss(output.values[part], micro.values, micro.returns, mask, args.cliprange_value)
        loss = loss + pg_loss + args.vf_coef * vf_loss
        for key, value in (
            ("policy/approxkl_avg", pg_stats["approxkl"]),
            ("policy/clipfrac_avg", pg_stats["clipfrac"]),
            ("loss/policy_avg", pg_loss.detach()),
            ("loss/value_avg", vf_loss.detach()),
            ("val/clipfrac_avg", vf_stats["clipfrac"]),
            ("policy/entropy_avg", ppo.masked_mean(output.entropy[part], mask)),
            ("val/ratio", pg_stats["ratio"]),
        ):
            stats[key].append(value)
        if detailed:
            for key, value in detailed_stats(micro, new_logprobs[part], output.values[part]).items():
                stats[key].append(value)
    divisor = loss_divisor(len(stats["loss/policy_avg"]), micro_batches_in_minibatch, models.is_deepspeed)
    models.accelerator.backward(loss / divisor)
    return stats


@torch.no_grad()
def detailed_stats(micro: Rollout, new_logprobs: torch.Tensor, new_values: torch.Tensor) -> dict:
    """The further stats of one micro-batch that TRL's first PPOTrainer reported (named as there, without its
    `ppo/` prefix), computed only when asked for: 0-d tensors, and the advantages and ratios of its response
    tokens (1-D, `TOKEN_STATS`). new_logprobs, new_values `[b, T]`: the update's forward."""
    mask = micro.response_mask
    log_ratio = new_logprobs - micro.logprobs
    return {
        "policy/policykl": ppo.masked_mean(-log_ratio, mask),
        "policy/advantages_mean": ppo.masked_mean(micro.advantages, mask),
        "val/vpred": ppo.masked_mean(new_values, mask),
        "val/error": ppo.masked_mean((new_values - micro.returns) ** 2, mask),
        "returns/mean": ppo.masked_mean(micro.returns, mask),
        "returns/var": ppo.masked_var(micro.returns, mask),
        "val/mean": ppo.masked_mean(micro.values, mask),
        "val/var": ppo.masked_var(micro.values, mask),
        "policy/advantages": micro.advantages[mask].float(),
        "policy/ratio": torch.exp(log_ratio)[mask].float(),
    }


def judge_minibatch(minibatch_stats: dict, accelerator, args, update: int) -> Verdict:
    """The minibatch's verdict, from values reduced over all processes so that every process decides the same:
    NONFINITE when a loss is NaN/inf, SKIP when its mean ratio exceeds `ratio_threshold`, STOP when its mean
    approximate KL exceeds 1.5 * `target_kl` (`early_stopping`), else STEP."""
    losses = torch.stack(minibatch_stats["loss/policy_avg"] + minibatch_stats["loss/value_avg"])
    finite = torch.isfinite(losses).all().float().reshape(1)
    if accelerator.reduce(finite, reduction="sum").item() != accelerator.num_processes:
        return Verdict.NONFINITE
    if args.ratio_threshold is not None:
        ratio = accelerator.reduce(torch.stack(minibatch_stats["val/ratio"]).mean().reshape(1), "mean").item()
        if ratio > args.ratio_threshold:
            logger.warning(
                f"A minibatch of update {update} has a mean probability ratio of {ratio:.3g} > ratio_threshold "
                f"({args.ratio_threshold}): skipped."
            )
            return Verdict.SKIP
    if args.early_stopping:
        approxkl = torch.stack(minibatch_stats["policy/approxkl_avg"]).mean().reshape(1)
        if accelerator.reduce(approxkl, "mean").item() > 1.5 * args.target_kl:
            return Verdict.STOP
    return Verdict.STEP


def nonfinite_error(update: int, deepspeed: bool, last_checkpoint: str | None) -> FloatingPointError:
    """The error that stops a run at a non-finite loss (without `skip_nonfinite_updates`)."""
    step = "DeepSpeed has already stepped with it" if deepspeed else "no optimizer step was taken"
    return FloatingPointError(
        f"Non-finite PPO loss at update {update}; {step}. Last complete checkpoint: {last_checkpoint or 'none'}. "
        "Lower `learning_rate`, check the reward scale, or set `skip_nonfinite_updates=True` to skip such updates."
    )

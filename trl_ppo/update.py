"""The PPO update of one rollout: `num_ppo_epochs` passes over shuffled minibatches, gradients accumulated over
micro-batches, one optimizer step per minibatch, with its guards (non-finite losses, `ratio_threshold`,
`early_stopping`). The losses themselves are in `ppo.py`."""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
from transformers.utils import logging

from . import checkpoint as ckpt
from . import ppo
from .rollout import Rollout, chunks, masked_response_logprobs

logger = logging.get_logger(__name__)


class PPOUpdateMixin:
    """`ppo_update` for `PPOTrainer`; it relies on the trainer's `args`, `model`, `optimizer`, `accelerator`,
    `state` and `_skipped_updates`."""

    def ppo_update(self, rollout: Rollout, advantages: torch.Tensor, returns: torch.Tensor) -> dict:
        """`num_ppo_epochs` passes over the batch in shuffled minibatches, one optimizer step per minibatch,
        accumulating gradients over micro-batches. Returns per-micro-batch stats, each `[n]` (with
        `early_stopping` / `ratio_threshold`, also the update's `policy/early_stop_frac` /
        `policy/skipped_minibatches`)."""
        args = self.args
        stats = defaultdict(list)
        planned, stepped, skipped, stop = args.num_ppo_epochs * args.num_mini_batches, 0, 0, False
        self.model.train()
        for epoch in range(args.num_ppo_epochs):
            order = torch.randperm(args.local_batch_size, device=advantages.device)
            for minibatch in order.split(args.local_mini_batch_size):
                micro_batches = minibatch.split(args.per_device_train_batch_size)
                passes = minibatch.split(args.train_forward_batch_size)  # whole micro-batches each
                minibatch_stats = defaultdict(list)
                for i, episodes in enumerate(passes):
                    with self._accumulating(last=i == len(passes) - 1):
                        pass_stats = self._ppo_forward_backward(
                            rollout.select(episodes), advantages[episodes], returns[episodes], len(micro_batches)
                        )
                    for key, values in pass_stats.items():
                        minibatch_stats[key].extend(values)
                if not self._losses_are_finite(minibatch_stats):
                    self.optimizer.zero_grad()
                    self._skip_nonfinite_update(epoch)
                    return {key: torch.stack(values) for key, values in stats.items()}
                for key, values in minibatch_stats.items():
                    stats[key].extend(values)
                verdict = self._minibatch_guard(minibatch_stats)
                if verdict != "step":
                    self.optimizer.zero_grad()
                    skipped += verdict == "skip"
                    stop = verdict == "stop"
                    if stop:
                        break  # early stopping: the rest of this update's minibatches and epochs
                    continue
                if args.max_grad_norm:
                    self.accelerator.clip_grad_norm_(self.model.parameters(), args.max_grad_norm)
                self.optimizer.step()
                self.optimizer.zero_grad()
                stepped += 1
            if stop:
                break
        stats = {key: torch.stack(values) for key, values in stats.items()}
        if args.early_stopping:
            stats["policy/early_stop_frac"] = torch.tensor([stepped / planned], device=advantages.device)
        if args.ratio_threshold is not None:
            stats["policy/skipped_minibatches"] = torch.tensor([float(skipped)], device=advantages.device)
        return stats

    def _accumulating(self, last: bool):
        """The context of one micro-batch's backward: gradients are synchronised (and, under DeepSpeed, the optimizer
        steps) only after the minibatch's `last` micro-batch."""
        if self.is_deepspeed_enabled:
            # DeepSpeed reads the boundary from accelerate's flag (`Trainer` keeps accelerate's own accumulation off).
            self.accelerator.gradient_state._set_sync_gradients(last)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if last else self.accelerator.no_sync(self.model)

    def _minibatch_guard(self, minibatch_stats: dict) -> str:
        """What to do with a minibatch whose gradients are ready: "skip" it when its mean ratio exceeds
        `ratio_threshold`, "stop" the update when its mean approximate KL exceeds 1.5 * `target_kl`
        (`early_stopping`), else "step". Decided on values averaged over all processes, so that every process
        decides the same."""
        args = self.args
        if args.ratio_threshold is not None:
            ratio = self.accelerator.reduce(torch.stack(minibatch_stats["val/ratio"]).mean().reshape(1), "mean")
            if ratio.item() > args.ratio_threshold:
                logger.warning(
                    f"A minibatch of update {self.state.global_step + 1} has a mean probability ratio of "
                    f"{ratio.item():.3g} > ratio_threshold ({args.ratio_threshold}): skipped."
                )
                return "skip"
        if args.early_stopping:
            approxkl = torch.stack(minibatch_stats["policy/approxkl_avg"]).mean().reshape(1)
            if self.accelerator.reduce(approxkl, "mean").item() > 1.5 * args.target_kl:
                return "stop"
        return "step"

    def _losses_are_finite(self, minibatch_stats: dict) -> bool:
        losses = torch.stack(minibatch_stats["loss/policy_avg"] + minibatch_stats["loss/value_avg"])
        finite = torch.isfinite(losses).all().float().reshape(1)
        return bool(self.accelerator.reduce(finite, reduction="sum").item() == self.accelerator.num_processes)

    def _skip_nonfinite_update(self, epoch: int) -> None:
        """Drop the rest of an update whose loss is not finite, or stop the run, as `skip_nonfinite_updates` says."""
        update = self.state.global_step + 1
        if not self.args.skip_nonfinite_updates:
            last = ckpt.latest_checkpoint(self.args.output_dir)
            step = (
                "DeepSpeed has already stepped with it" if self.is_deepspeed_enabled else "no optimizer step was taken"
            )
            raise FloatingPointError(
                f"Non-finite PPO loss at update {update} (PPO epoch {epoch + 1}); {step}. Last complete checkpoint: "
                f"{last or 'none'}. Lower `learning_rate`, check the reward scale, or set "
                "`skip_nonfinite_updates=True` to skip such updates."
            )
        self._skipped_updates += 1
        logger.warning(
            f"Non-finite PPO loss at update {update}: the rest of this update is skipped "
            f"({self._skipped_updates} skipped so far)."
        )

    def _ppo_forward_backward(self, episodes: Rollout, advantages, returns, num_micro_batches: int) -> dict:
        """One forward/backward over whole micro-batches of a minibatch (`train_forward_batch_size` episodes),
        without the padding columns common to all of them (`Rollout.trim_padding`).

        The loss is computed per micro-batch (masked means over that micro-batch's tokens) and summed, so the
        gradient equals that of one pass per micro-batch. -> per-micro-batch stats, each a list of scalars."""
        args = self.args
        episodes = episodes.trim_padding()
        advantages, returns = advantages[:, : episodes.response_length], returns[:, : episodes.response_length]
        with self.accelerator.autocast():
            output = self.model(
                episodes.input_ids,
                episodes.attention_mask,
                episodes.responses,
                args.temperature,
                args.logprobs_chunk_size,
                entropy=True,
            )
        new_logprobs = masked_response_logprobs(output.logprobs, episodes)
        new_values, entropy = output.values, output.entropy
        stats, loss = defaultdict(list), 0.0
        for part in chunks(episodes.queries.size(0), args.per_device_train_batch_size):
            mask = episodes.response_mask[part]
            pg_loss, pg_stats = ppo.policy_loss(
                new_logprobs[part], episodes.logprobs[part], advantages[part], mask, args.cliprange
            )
            vf_loss, vf_stats = ppo.value_loss(
                new_values[part], episodes.values[part], returns[part], mask, args.cliprange_value
            )
            loss = loss + pg_loss + args.vf_coef * vf_loss
            for key, value in (
                ("policy/approxkl_avg", pg_stats["approxkl"]),
                ("policy/clipfrac_avg", pg_stats["clipfrac"]),
                ("loss/policy_avg", pg_loss.detach()),
                ("loss/value_avg", vf_loss.detach()),
                ("val/clipfrac_avg", vf_stats["clipfrac"]),
                ("policy/entropy_avg", ppo.masked_mean(entropy[part], mask)),
                ("val/ratio", pg_stats["ratio"]),
            ):
                stats[key].append(value)
        # Mean over the minibatch's micro-batches. DeepSpeed divides by its gradient_accumulation_steps itself,
        # which is the number of passes per minibatch (`fit_deepspeed_batch_layout`).
        micro_batches_here = len(stats["loss/policy_avg"])
        divisor = micro_batches_here if self.is_deepspeed_enabled else num_micro_batches
        self.accelerator.backward(loss / divisor)
        return stats

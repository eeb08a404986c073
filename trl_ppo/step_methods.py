"""`generate()`, `step()`, `update_on_episodes()` and `log_stats()`: `PPOTrainer`'s API for episodes made outside
the trainer (that of TRL's first PPOTrainer, which `trl_ppo.legacy` adapts), as a mixin of `PPOTrainer`. Each is
`train()`'s steps after sampling, called on checked episodes; the checks and the episodes-as-a-`Rollout` pieces are
in `step_api.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from . import distributed as dist
from . import step_api as episodes
from .completions import show_table
from .kl import next_kl_coef
from .models import context_length


class StepMethods:
    """Mixed into `PPOTrainer`: uses its models, config, run state and the steps of `train()` (`compute_rewards`,
    `compute_advantages`, `ppo_update`, ...)."""

    @torch.no_grad()
    def generate(
        self,
        query_tensor: torch.Tensor | Sequence[torch.Tensor],
        return_prompt: bool = True,
        batch_size: int | None = None,
        length_sampler: Callable[[], int] | None = None,
        reference: bool = False,
        **generation_kwargs,
    ) -> torch.Tensor | list[torch.Tensor]:
        """The response (ids after the query when `return_prompt`; cut at the stop token, no padding) to one query
        (1-D token ids) or to each of a list, sampled `batch_size` queries at a time (default
        `local_rollout_forward_batch_size`). `generation_kwargs` may set `max_new_tokens`, `temperature` and
        `eos_token_id`; other options (top_k > 0, ...) sample with `transformers`' `generate`; `length_sampler()`
        draws `max_new_tokens` for each batch. `reference=True` samples from the reference policy instead."""
        single = isinstance(query_tensor, torch.Tensor) and query_tensor.dim() == 1
        queries = episodes.check_token_lists([query_tensor] if single else list(query_tensor), "query_tensor")
        batch_size = self.args.local_rollout_forward_batch_size if batch_size is None else batch_size
        options = (batch_size, return_prompt, length_sampler, generation_kwargs, self.vocabulary_size)
        with episodes.sampling_models(self._models(), reference, self.args) as models:
            results = episodes.generate_responses(queries, models, self._sampling(), *options)
        return results[0] if single else results

    def step(
        self,
        queries: Sequence[torch.Tensor],
        responses: Sequence[torch.Tensor],
        scores: Sequence[float] | torch.Tensor,
        response_masks: Sequence[torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """One PPO update, as one of `train()` after its scoring, on this process's `local_batch_size` episodes:
        `queries`, `responses` 1-D token ids (responses as produced: stop token included, no padding), one score each
        (floats, 0-d tensors or `[B]`), `response_masks` 1-D 0/1 leaving tokens out of training. -> the metrics."""
        limits = (self.args.local_batch_size, self.vocabulary_size, context_length(self._models().wrapper.lm))
        check = functools.partial(episodes.check_episodes, queries, responses, scores, response_masks, *limits,
                                  self.processing_class)
        checked = dist.checked_on_every_process(check, self.accelerator.device, "`step()` episodes")  # no hang
        return self.update_on_episodes(*checked).metrics

    def update_on_episodes(
        self,
        queries: list[torch.Tensor],
        responses: list[torch.Tensor],
        scores: torch.Tensor,
        response_masks: list[torch.Tensor] | None = None,
        detailed: bool = False,
    ) -> episodes.EpisodeUpdate:
        """`step()` on checked episodes: logprobs, ref_logprobs, values → KL-shaped rewards → advantages → PPO
        epochs → adapt the KL coefficient → step the schedule → count / log / save. -> everything it made, and
        the seconds each phase took (`trl_ppo.legacy` reports both)."""
        if self.args.max_staleness:
            raise ValueError(
                f"`step()` trains on the episodes it is given, sampled by its caller, and `max_staleness="
                f"{self.args.max_staleness}` is the sampler process of `train()`: set `max_staleness=0` to use "
                "`step()`, or use `train()`."
            )
        clock = episodes.PhaseClock()
        self._begin_step_run()  # the first step begins the run; after `train()` ended, that run goes on
        pad_token_id, device = self.processing_class.pad_token_id, self.accelerator.device
        rollout = self.add_logprobs_and_values(
            episodes.rollout_of(queries, responses, pad_token_id, device, response_masks)
        )
        rollout.scores = scores.to(rollout.queries.device)
        clock.lap("forward_pass")
        rewards = self.compute_rewards(rollout)
        clock.lap("compute_rewards")
        advantages = self.compute_advantages(rollout, rewards)
        self._write_trajectories(self.state.global_step + 1, rollout, rewards, advantages)
        clock.lap("compute_advantages")
        result = self.ppo_update(rollout, advantages, detailed)
        clock.lap("optimize_step")
        metrics = self._update_metrics(rollout, rewards, result.stats, {}, rollout, advantages)
        self.run.kl_coef = next_kl_coef(self.run.kl_coef, metrics["objective/kl"], self.args)
        self.lr_scheduler.step()
        metrics = self._end_update(metrics)
        return episodes.EpisodeUpdate(rollout, rewards, advantages, result, metrics, clock.seconds)

    def log_stats(self, stats: dict, batch: dict, rewards, columns_to_log: Sequence[str] = ("query", "response")):
        """Log `step()`'s `stats` to the configured trackers (`report_to`), and show a table of the batch's
        `columns_to_log` (texts, or token-id tensors that are decoded) with each episode's reward."""
        self.log({key: float(value) for key, value in stats.items()})
        rows = episodes.episode_rows(batch, rewards, columns_to_log, self.processing_class)
        if self.accelerator.is_main_process:
            step = self.state.global_step
            show_table(rows, f"Episodes of update {step}", self.args.report_to, step, key="episodes")

"""`PPOTrainer`'s methods for where an update's episodes come from: sampled and scored now (synchronous, the
default), or by a sampler process that runs `max_staleness` batches ahead (`rollout.asynchronous`), with what that
changes around it: the weights published after each update, the proximal log-probs and values recomputed at training
time, the metrics of staleness, and a checkpoint that keeps the batches in flight."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from transformers.utils import logging

from . import checkpoint as ckpt
from .async_loop import is_async_callable
from .checkpoint.rng import read_rng_file
from .deadlines import add_counts, take_counts
from .off_policy import behaviour_weights
from .rollout import Rollout, add_logprobs_and_values
from .rollout.agreement import agreement_metrics, agreement_sums
from .rollout.asynchronous import ASYNC_STATE, AsyncSampler, SamplerWork
from .rollout.generation import takes_generator

logger = logging.get_logger(__name__)


def check_async_layout(args, accelerator, is_deepspeed: bool, fsdp_version: int | None) -> None:
    """What `max_staleness` >= 1 cannot run with, refused before any compute."""
    if not args.max_staleness:
        return
    why = None
    if accelerator.num_processes > 1 or is_deepspeed or fsdp_version:
        why = "runs in one process without DeepSpeed or FSDP (several processes: see docs/scaling-out.md)"
    elif accelerator.device.type != "cpu":
        why = "forks its sampler process from the trainer's, which a process that uses CUDA cannot do: CPU only"
    elif args.kl_penalty == "full":
        why = "computes the reference's log-probs in the sampler, and `kl_penalty='full'` needs its logits beside "
        why += "the policy's at training time: use `kl_penalty='kl'`"
    if why:
        raise ValueError(f"`max_staleness={args.max_staleness}` {why}.")


class AsyncMethods:
    """Where `train()`'s rollouts come from (`_sample_and_score`), and the sampler process's life around it."""

    _async_sampler: AsyncSampler | None = None
    _restored_sampler: dict | None = None
    _policy_version: int | None = None  # the sampler process's: the version its policy copy holds

    def _start_sampler(self, batches) -> None:
        """With `max_staleness` >= 1, fork the sampler process and send it the first batches."""
        if not self.args.max_staleness:
            return
        generator = self._sampler_generator()
        scorers = self._sampler_scorers() if generator is not None else 0
        work = SamplerWork(self._sample_ahead, self._score_ahead, scorers, generator, self._sampler_loaded)
        self._async_sampler = AsyncSampler(
            work, self._models().wrapper.lm, self.args.max_staleness, batches,
            self.state.global_step, self.args.num_total_batches, self._restored_sampler,
        )  # fmt: skip
        self._restored_sampler = None

    def _stop_sampler(self) -> None:
        if self._async_sampler is not None:
            self._async_sampler.close()
            self._async_sampler = None

    def _sampler_loaded(self, version: int) -> None:
        """In the sampler process: its policy now holds the weights of `version` (what its engine samples with)."""
        self._policy_version = version

    def _sample_and_score(self, batches, update: int) -> tuple[Rollout, dict]:
        """The episodes of `update`, scored -> (rollout with `logprobs`, `ref_logprobs`, `values` and `scores`,
        scores per reward). Asynchronous: sampled ahead by the sampler process (its log-probs become the behaviour
        policy's, `sampler_logprobs`); the proximal policy's log-probs and the values computed here, now."""
        if self._async_sampler is None:
            return self._sample_and_score_now(next(batches))
        sampled = self._async_sampler.next(update)
        rollout = sampled.rollout
        if self.agents is not None:  # the episodes' records, for the `env/` metrics and `trajectory_dir`
            self.agents.episodes = sampled.extra["episodes"]
        add_counts(*sampled.extra["calls"])  # `calls/timeouts`, `calls/retries`
        add_logprobs_and_values(rollout, self._models(), self.args, reference=False)  # the proximal policy's
        self._staleness = update - 1 - sampled.version
        return rollout, sampled.scores_per_reward

    def _sample_and_score_now(self, batch: dict) -> tuple[Rollout, dict]:
        """Sample `batch` with the policy as it is, then score it (the sampler process's work too)."""
        rollout = self.collect_rollout(batch)  # sample; logprobs, ref_logprobs, values
        rollout.scores, scores_per_reward = self.score(rollout, batch)
        return rollout, scores_per_reward

    def _sample_ahead(self, update: int, batch: dict, generator=None) -> Rollout:
        """The sampler process's sampling of `update`'s episodes, with its (older) weights, drawing from
        `generator`. The behaviour policy's log-probs are the sampler's own where it records them (the episode
        engine: the policy's forward is then skipped), else this process's forward; the values are left to the
        trainer, which computes them with its current critic."""
        self.state.global_step = update - 1  # this process's copy: what its errors name
        rollout = self.collect_rollout(batch, behaviour_only=True, generator=generator)
        if rollout.sampler_logprobs is None:
            rollout.sampler_logprobs = rollout.logprobs
        return rollout

    def _score_ahead(self, update: int, rollout: Rollout, batch: dict) -> tuple[dict, dict]:
        """The sampler process's scoring of `update`'s episodes -> (scores per reward, extra). `extra`: with tools
        or environments, the episodes' records without their environments and tools (they stay, and are closed,
        in this process); the counts of calls into user code that timed out or were retried (this process's since
        the last batch scored: with batches scored at once, a count may land on a neighbour's update)."""
        rollout.scores, scores_per_reward = self._scoring()(rollout, batch, where=f"Update {update}")
        episodes = None
        if self.agents is not None:
            episodes = [dataclasses.replace(episode, environment=None, tools={}) for episode in self.agents.episodes]
        return scores_per_reward, {"episodes": episodes, "calls": take_counts()}

    def _sampler_generator(self) -> torch.Generator | None:
        """What the sampler's sampling draws from: a generator of its own, seeded from the run's seed, the process
        and the update the sampler starts after (a run resumed from a synchronous checkpoint draws anew, and
        repeats); None where the sampling takes no generator (transformers' `generate`: `generation_backend`
        'generate' or 'compiled'), which then draws from the process's own, and is not run beside scoring."""
        if not takes_generator(self.sampling_backend):
            return None
        seed = np.random.SeedSequence([self.args.seed, self.accelerator.process_index, self.state.global_step])
        return torch.Generator().manual_seed(int(seed.generate_state(1, dtype=np.uint64)[0]))

    def _sampler_scorers(self) -> int:
        """How the sampler scores beside sampling (`SamplerWork.scorers`): agents one batch after the other (a
        batch's environments live until it is scored); `async` reward functions up to `max_staleness` + 1
        batches at once (as many as can be in flight); anything else one batch while the next samples."""
        if self.agents is not None:
            return 0
        if all(not reward.is_model and is_async_callable(reward.source) for reward in self.rewards):
            return self.args.max_staleness + 1
        return 1

    def _publish_weights(self, update: int) -> None:
        """After `update`: the sampler samples with the new weights from the batch that is due to."""
        if self._async_sampler is not None:
            self._async_sampler.publish(self._models().wrapper.lm, update)

    def _sampling_metrics(self, rollout: Rollout) -> dict[str, float]:
        """Asynchronous runs: `offpolicy/staleness` (updates between the sampling policy and this update's start)
        and how far the behaviour policy's log-probs are from the proximal policy's (`rollout/logprob_diff_*`).
        With an `off_policy_correction` and the sampler's log-probs: `offpolicy/is_weight_mean`, `_max` (the raw
        pi_prox / pi_behav over the update's tokens) and `offpolicy/is_truncated_frac` (tokens above `tis_cap`: cut
        by "tis", dropped by "mis")."""
        args, metrics = self.args, {}
        if self._async_sampler is not None:
            sums = agreement_sums(rollout.sampler_logprobs, rollout.logprobs, rollout.response_mask)
            metrics = {"offpolicy/staleness": float(self._staleness)} | agreement_metrics(sums[None])
        if args.off_policy_correction is not None and rollout.sampler_logprobs is not None:
            _, stats = behaviour_weights(rollout.logprobs, rollout.sampler_logprobs, rollout.response_mask,
                                         args.off_policy_correction, args.tis_cap)  # fmt: skip
            metrics |= {f"offpolicy/{name}": float(value) for name, value in stats.items()}
        return metrics

    def _write_checkpoint(self, resume_point: ckpt.ResumePoint | None = None) -> str:
        """A checkpoint; asynchronous: with the batches the sampler sampled ahead and its RNG, so that a resume
        trains on exactly what the run would have."""
        if self._async_sampler is not None:
            resume_point = resume_point if resume_point is not None else ckpt.ResumePoint.capture(self.run)
            resume_point.rng[ASYNC_STATE] = self._async_sampler.state_dict()
        return super()._write_checkpoint(resume_point)

    def _restore_checkpoint(self, path: str) -> None:
        super()._restore_checkpoint(path)
        state = read_rng_file(path, self.accelerator.process_index).get(ASYNC_STATE)
        if state is not None and not self.args.max_staleness:
            logger.warning(
                f"{path} holds {len(state['pending'])} batch(es) a sampler process sampled ahead (`max_staleness`), "
                "and this run is synchronous: they are dropped, and their prompts skipped."
            )
        self._restored_sampler = state if self.args.max_staleness else None

    def _may_drop_rollout(self) -> bool:
        """Whether a stop may drop the update's rollout before optimising (synchronous runs: it is resampled on
        resume). The sampler's batches cannot be resampled, so an asynchronous run finishes the update first."""
        return self._async_sampler is None

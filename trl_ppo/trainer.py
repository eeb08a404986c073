"""`PPOTrainer`: the PPOv2 loop on top of `transformers.Trainer`, composed from this package's pieces.

`train()` reads like the algorithm: sample → score → KL-shaped rewards → advantages → PPO epochs → adapt the KL
coefficient → step the learning-rate schedule → log / evaluate / save. Each step is a short method that hands the
models, the config and the run's state (`run_state.RunState`) to a piece with explicit inputs: `rollout.py`
(sampling, log-probs, values), `rewards.py` (scores), `ppo.py` (the math), `update.py` (the PPO epochs),
`evaluation.py`, `completions.py`, `checkpoint/` and `saving.py`. Four mixins add methods: `evaluate()` and
`generate_completions()` (`evaluation.EvaluationMethods`), `step()`, which runs the same steps on episodes made
outside the trainer (`step_methods.StepMethods`), `create_optimizer()` with the critic's own learning rate
(`critic.CriticMethods`), and where each update's episodes come from, sampled now or by a sampler process running
`max_staleness` batches ahead (`asynchronous_ppo.AsyncMethods`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase, TrainerCallback, set_seed
from transformers.trainer_utils import TrainOutput
from transformers.utils import logging

from . import checkpoint as ckpt
from . import critic, data, estimators, fsdp, ppo, preparation, reporting, saving, trajectories
from . import distributed as dist
from . import update as ppo_epochs
from .agents.runner import agent_runner
from .asynchronous_ppo import AsyncMethods, check_async_layout
from .config import PPOConfig
from .config_checks import stop_and_penalty_tokens
from .evaluation import EvaluationMethods
from .kl import next_kl_coef
from .metrics import critic_metrics, update_metrics
from .models import (
    PolicyAndValueWrapper,
    PreparedModels,
    is_peft_model,
    shared_parameters,
    vocabulary_size,
)
from .on_policy_trainer import OnPolicyTrainer
from .preparation import initial_fingerprints, prepare_all_models, prepare_data, refuse_old_names, validate_inputs
from .rewards import Scoring
from .rollout import Rollout, Sampling, add_logprobs_and_values, collect_rollout
from .rollout.generation import resolve_backend
from .step_methods import StepMethods
from .vllm_methods import EngineMethods, check_engine_layout

logger = logging.get_logger(__name__)


class PPOTrainer(EvaluationMethods, StepMethods, critic.CriticMethods, EngineMethods, AsyncMethods, OnPolicyTrainer):
    """Train a causal LM policy with PPO against a reward, keeping it close to a reference policy.

    Args:
        args: a `PPOConfig`.
        processing_class: the policy's tokenizer (prompts are left-padded: a pad token is needed, from the first
            `generate()` / `step()` when the trainer has no datasets, else at once).
        model: the policy, a causal LM.
        ref_model: the reference policy; `None` makes a frozen copy of `model`, or with PEFT uses `model` with
            its adapter disabled (no second copy of the weights).
        reward_model: a sequence-classification model with a scalar `score` head, a callable
            `f(prompts, completions, **columns) -> list[float | None]` (plain or async), or a list mixing them
            (combined with `args.reward_weights`); None when only `step()` trains, on scores given to it.
        train_dataset: prompts, as `input_ids` or as a `prompt` column (text or chat messages). Only `step()`
            works without one (then set `args.total_episodes`).
        value_model: a sequence-classification model with one label, trained alongside the policy; `None` gives
            the policy a value head on its own backbone (`AutoModelForCausalLMWithValueHead`).
        data_collator: defaults to left-padding of `input_ids`.
        eval_dataset: prompts for `evaluate()` (run every `eval_steps` with `eval_strategy="steps"`) and the
            sample completions tables.
        optimizers: `(optimizer, lr_scheduler)`; by default AdamW and the `lr_scheduler_type` schedule, stepped
            once per PPO update.
        callbacks: extra `TrainerCallback`s.
        peft_config: a `peft.PeftConfig` to train an adapter instead of the whole policy.
        reward_processing_class: a tokenizer per reward model (same order; None for one sharing the policy's):
            the decoded prompt and response are re-encoded with it before that model scores them.
        tools, environment_factory: multi-turn episodes (`max_turns` >= 2): functions the model may call (sync or
            async), and one environment per episode (a class or a function returning one, or `{name: either}`),
            closed once scored (`close()`); its `get_reward` may be the only reward (`reward_model=[]`); see
            `trl_ppo.agents`.
    """

    _tag_names = ["trl_ppo", "ppo"]

    @refuse_old_names
    def __init__(
        self,
        args: PPOConfig,
        processing_class: PreTrainedTokenizerBase,
        model: nn.Module,
        ref_model: nn.Module | None,
        reward_model=None,
        train_dataset=None,
        value_model: nn.Module | None = None,
        data_collator=None,
        eval_dataset=None,
        optimizers: tuple = (None, None),
        callbacks: list[TrainerCallback] | None = None,
        peft_config=None,
        reward_processing_class=None,
        tools=None,
        environment_factory=None,
    ) -> None:
        tokenizer = processing_class
        rewards = validate_inputs(args, tokenizer, reward_model, reward_processing_class, environment_factory)
        given = reward_model is not None
        self.agents = agent_runner(args, tokenizer, tools, environment_factory, rewards, train_dataset, given)
        model = preparation.policy_to_train(args, model, value_model)  # with its value function, unless critic-free
        datasets = prepare_data(args, tokenizer, train_dataset, eval_dataset, model, rewards, self._passed_columns())
        train_dataset, eval_dataset = datasets
        fingerprints = initial_fingerprints(model, ref_model, value_model, rewards, train_dataset)
        model, ref_model = prepare_all_models(args, tokenizer, model, ref_model, value_model, rewards, peft_config)

        self.stop_token_id, self.penalty_token_id = stop_and_penalty_tokens(args, tokenizer)
        self.rewards, self.reward_model, self.is_peft_model = rewards, reward_model, is_peft_model(model)
        self.model_card_dataset: str | None = None  # what the model card calls the prompts (the CLI sets it)
        self.stop_signal: str | None = None  # a SIGTERM/SIGINT that came at the end of `train()` (it finished)
        collator = data.LeftPaddingCollator(tokenizer.pad_token_id) if data_collator is None else data_collator
        wrapper = PolicyAndValueWrapper(model, value_model, estimators.uses_critic(args.advantage_estimator))
        datasets, names = (train_dataset, eval_dataset), [reward.name for reward in rewards]
        super().__init__(args, tokenizer, wrapper, *datasets, collator, callbacks, optimizers, fingerprints, names)
        self._prepare_distributed(ref_model)

    def _prepare_distributed(self, ref_model: nn.Module | None) -> None:
        """Check what the launch layout cannot do, create the optimizer and schedule, and place every model:
        the trained ones through `accelerator.prepare`, the frozen ones for inference (partitioned under ZeRO-3)."""
        args, accelerator = self.args, self.accelerator
        stage = dist.deepspeed_zero_stage(accelerator)
        shares_layers = ref_model is not None and bool(shared_parameters(ref_model, self.model.policy))
        fsdp_version = fsdp.fsdp_version(accelerator)
        dist.check_supported(args, self.is_deepspeed_enabled, fsdp_version, stage, shares_layers)
        check_async_layout(args, accelerator, self.is_deepspeed_enabled, fsdp_version)
        check_engine_layout(args, accelerator, self.is_deepspeed_enabled, fsdp_version, self.model.policy)
        fsdp.check_settings(accelerator)
        fsdp.keep_float32_outputs(accelerator)
        self.sampling_backend = resolve_backend(
            args.generation_backend, accelerator.device, stage, self.is_peft_model, fsdp2=fsdp_version == 2
        )
        if self.train_dataset is not None:  # a collator that pads on the wrong side fails before any rollout
            rows = [self.train_dataset[i] for i in range(min(len(self.train_dataset), 8))]
            data.prompts_on_device(self.data_collator(rows), accelerator.device, self.processing_class.pad_token_id)

        self.create_optimizer_and_scheduler(num_training_steps=args.num_total_batches)
        self.callback_handler.optimizer, self.callback_handler.lr_scheduler = self.optimizer, self.lr_scheduler
        dist.fit_deepspeed_batch_layout(accelerator, args.train_forward_batch_size, args.local_mini_batch_size)
        self.model, self.optimizer = accelerator.prepare(self.model, self.optimizer)
        fsdp.enable_root_calls(self.model)  # FSDP2: sampling runs the policy's parts as a forward of the wrapper
        # Not given to `accelerator.prepare`: it would shard the batches a second time (the sampler already gives
        # each process its slice of every global batch).
        self.train_dataloader = None if self.train_dataset is None else self.get_train_dataloader()
        self.model_wrapped = self.model
        if self.is_deepspeed_enabled:
            self.deepspeed = self.model  # `Trainer.save_model` / checkpointing read the engine from here
        self.ref_model, self._inference_engines = dist.place_frozen_models(ref_model, self.rewards, accelerator)
        # Every process samples with its own seed; the data order was fixed from `seed` alone.
        set_seed(dist.process_seed(args.seed, accelerator.process_index))
        self.sample_generations_freq = max(1, args.num_total_batches // max(1, args.num_sample_generations))

    # ----------------------------------------------------------------------------------------- the loop
    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, **kwargs) -> TrainOutput:
        """Run the PPO updates, each: sample → score → KL-shaped rewards → advantages → PPO epochs → adapt the
        KL coefficient → step the learning-rate schedule → log / evaluate / save.

        `resume_from_checkpoint`: a checkpoint folder, True for the newest complete one in `output_dir`, "auto": that
        one or, where there is none, a fresh run. On SIGTERM/SIGINT the update in progress is finished (or, if its
        optimisation has not begun, dropped), a checkpoint is written and the process exits with status 0. During
        the last update, or while the run's end is written (log, curves), the run is finished instead and
        `stop_signal` names the signal: the caller then saves the model and stops (`save_model` finishes its write
        before honouring a signal).
        """
        args = self.args
        if self.train_dataset is None:
            raise ValueError("`train()` samples from `train_dataset`, and none was given (use `step()` without one).")
        self._scoring()  # without a reward, fail before any compute
        self._start_run(resume_from_checkpoint)
        try:  # the run lock of `output_dir` (taken by `_start_run`) is released however the run ends
            return self._run_updates()
        finally:
            ckpt.release_run_lock(args.output_dir)

    def _run_updates(self) -> TrainOutput:
        """`train()`'s updates, from the one after `state.global_step` to the last, then the run's end."""
        args = self.args
        if args.eval_on_start and self.state.global_step == 0:
            self.evaluate()
        batches = data.batches_forever(self.train_dataloader, self._sampler, self.run)
        self._start_sampler(batches)  # with `max_staleness`: a process that samples ahead
        with ckpt.PreemptionHandler() as preemption, contextlib.ExitStack() as stack:
            stack.callback(self._stop_sampler)
            for update in range(self.state.global_step + 1, args.num_total_batches + 1):
                start_of_update = ckpt.ResumePoint.capture(self.run)
                self._begin_update(update)

                rollout, scores_per_reward = self._sample_and_score(batches, update)  # logprobs, ref, values, scores
                rewards = self.compute_rewards(rollout)  # score - kl_coef * KL, per token
                trained = self.trained_episodes(rollout)  # `truncated_episodes="mask"` leaves the truncated out
                advantages = self.compute_advantages(trained, rewards)  # GAE, or a group estimator
                last = update == args.num_total_batches  # a stop then finishes the run instead
                if not last and self._may_drop_rollout() and ckpt.stop_requested(preemption, self.accelerator):
                    self._exit_after_checkpoint(preemption.requested, start_of_update)  # drops this rollout
                update_stats = self.ppo_update(trained, advantages).stats
                self._write_trajectories(update, trained, rewards, advantages)  # applied: with `trajectory_dir`

                metrics = self._update_metrics(rollout, rewards, update_stats, scores_per_reward, trained, advantages)
                metrics |= self._sampling_metrics(rollout)  # with `max_staleness`: staleness, behaviour vs proximal
                self.run.kl_coef = next_kl_coef(self.run.kl_coef, metrics["objective/kl"], self.args)
                self.lr_scheduler.step()
                self._end_update(metrics)  # log / evaluate / save
                if not last and ckpt.stop_requested(preemption, self.accelerator):
                    self._exit_after_checkpoint(preemption.requested, None)
                self._publish_weights(update)  # with `max_staleness`: to the sampler, once the saves are done
                if self.control.should_training_stop:
                    break
            output = self._end_training()
            self.stop_signal = preemption.requested if ckpt.stop_requested(preemption, self.accelerator) else None
        return output

    def collect_rollout(self, batch: dict, behaviour_only: bool = False, generator=None) -> Rollout:
        """Sample one response per prompt of a collated batch, then compute `logprobs`, `ref_logprobs` and
        `values` `[B, T]` (no gradients; `behaviour_only`: the asynchronous sampler's, `add_logprobs_and_values`);
        with tools or environments, one multi-turn episode per prompt. `generator`: what sampling draws from
        (None: the process-wide generator)."""
        collect = collect_rollout if self.agents is None else self.agents.collect
        sampling = dataclasses.replace(self._sampling(), generator=generator, **self._engine_sampling())
        rollout = collect(batch, self._models(), sampling, self.args, behaviour_only=behaviour_only)
        if rollout.truncated is None and self.stop_token_id is not None:  # one turn: cut where it did not stop
            rollout.truncated = ~ppo.contains_stop_token(rollout.responses, rollout.response_mask, self.stop_token_id)
        return rollout

    def add_logprobs_and_values(self, rollout: Rollout) -> Rollout:
        """Fill `logprobs`, `ref_logprobs` and `values` `[B, T]` of a rollout (no gradients)."""
        return add_logprobs_and_values(rollout, self._models(), self.args)

    def score(self, rollout: Rollout, batch: dict) -> tuple[torch.Tensor, dict]:
        """Scores `[B]` (weighted sum of the rewards, minus `missing_eos_penalty` for responses without the stop
        token) and, per reward name, `(scores [B], present [B] or None)`."""
        return self._scoring()(rollout, batch, where=f"Update {self.state.global_step + 1}")

    def compute_rewards(self, rollout: Rollout) -> ppo.Rewards:
        """Per-token rewards `[B, T]`: `-kl_coef * KL` (the `kl_penalty` / `kl_estimator` term) on every response
        token, plus the shaped score on the last (and per-turn rewards on each turn's last model token)."""
        args, mask, kl_coef = self.args, rollout.response_mask, self.run.kl_coef
        kl = rollout.per_token_kl(args.kl_penalty, args.kl_estimator)
        shaped_scores = self._shaped_scores(rollout.scores)
        return ppo.kl_shaped_rewards(shaped_scores, kl, mask, kl_coef, args.whiten_rewards, rollout.turn_rewards)

    def _shaped_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores `[B]` as the rewards use them: scaled by the running moments (updated with these scores from all
        processes) and clipped, as `use_score_scaling`, `use_score_norm` and `score_clip` say."""
        args, moments = self.args, self.run.score_moments
        if args.use_score_scaling:
            moments.update(self.accelerator.gather(scores.float()))
        return ppo.shape_scores(
            scores, moments.mean, moments.std, args.use_score_scaling, args.use_score_norm, args.score_clip
        )

    def compute_advantages(self, rollout: Rollout, rewards: ppo.Rewards) -> ppo.Advantages:
        """GAE over the response tokens (or over the turns, `gae_level`) -> advantages (whitened) and returns, both
        `[B, T]` (decoupled or length-adaptive lambdas with `lam_value` / `length_adaptive_lam_alpha`; truncated
        episodes bootstrapped from V with `truncated_episodes="bootstrap"`). A critic-free `advantage_estimator`:
        its group estimate over each run of `num_generations` episodes instead, and no returns (`estimators`)."""
        return estimators.advantages_for(self.args, rewards.rewards, rewards.non_score_rewards, rewards.shaped_scores,
                                         rollout.turn_rewards, rollout.values, rollout.response_mask,
                                         rollout.truncated)  # fmt: skip

    def trained_episodes(self, rollout: Rollout) -> Rollout:
        """The rollout the update trains on: with `truncated_episodes="mask"`, its truncated episodes left out of
        the response mask (the metrics still see them all)."""
        if self.args.truncated_episodes != "mask" or rollout.truncated is None:
            return rollout
        return dataclasses.replace(rollout, response_mask=ppo.drop_truncated_episodes(rollout.response_mask,
                                                                                       rollout.truncated))

    def _write_trajectories(self, update: int, rollout: Rollout, rewards, advantages: ppo.Advantages) -> None:
        """With `trajectory_dir`, append this process's episodes of the update to its file (`trajectories.py`), once
        the update is applied: an update dropped at a stop writes nothing, and one that a resume redoes (killed
        before its checkpoint) is written again, its readers then reading the last copy."""
        if self.args.trajectory_dir is None:
            return
        rank, tokenizer = self.accelerator.process_index, self.processing_class
        played = self.agents.episodes if self.agents is not None and rollout.turn_rewards is not None else None
        records = trajectories.episode_records(update, rank, rollout, rewards, advantages, self.args, tokenizer, played)
        trajectories.write_update(self.args.trajectory_dir, rank, records)

    def ppo_update(
        self, rollout: Rollout, advantages: ppo.Advantages, detailed: bool = False
    ) -> ppo_epochs.UpdateResult:
        """`num_ppo_epochs` over the rollout in minibatches (`update.ppo_update`) -> its result: per-micro-batch
        stats `[n]` (and with `detailed`, those of TRL's first PPOTrainer). A non-finite loss or gradient norm stops
        the run, or with `skip_nonfinite_updates` ends the update and is counted (the learning-rate schedule still
        steps: it follows the update count)."""
        update, models = self.state.global_step + 1, self._models()
        result = ppo_epochs.ppo_update(rollout, advantages, models, self.optimizer, self.args, update, detailed)
        if result.nonfinite and not self.args.skip_nonfinite_updates:
            last = ckpt.latest_checkpoint(self.args.output_dir)
            raise ppo_epochs.nonfinite_error(update, self.is_deepspeed_enabled, last, result.nonfinite)
        if result.nonfinite:
            self.run.skipped_updates += 1
            logger.warning(
                f"Non-finite {result.nonfinite} at update {update}: the rest of this update is skipped "
                f"({self.run.skipped_updates} skipped so far)."
            )
        return result

    # ------------------------------------------------------------------------------ what the steps share
    @property
    def vocabulary_size(self) -> int:
        """The token ids the policy reads (`models.vocabulary_size`): prompts and `step()` episodes must be below."""
        return vocabulary_size(self._models().wrapper.lm, self.processing_class)

    def _models(self) -> PreparedModels:
        return PreparedModels(self.accelerator, self.model, self.ref_model)

    def _sampling(self) -> Sampling:
        pad_token_id = self.processing_class.pad_token_id
        return Sampling.from_config(self.args, self.sampling_backend, self.stop_token_id, pad_token_id)

    def _scoring(self) -> Scoring:
        if not self.rewards:
            raise ValueError(
                "Sampling and scoring responses needs a reward: pass `reward_model` (a model or a function), or an "
                "`environment_factory` whose environments define `get_reward`. Without one, only `step()` with "
                "scores you give can train."
            )
        args, autocast = self.args, self.accelerator.autocast
        done = None if self.agents is None else self.agents.close_environments  # the episodes end once scored
        pieces = (self.penalty_token_id, autocast, self._passed_columns(), done)
        return Scoring.from_config(self.rewards, self.processing_class, args, *pieces)

    def _passed_columns(self) -> tuple[str, ...]:
        """What the trainer passes to reward functions besides the dataset's columns."""
        return ("environments",) if self.agents is not None and self.agents.environments is not None else ()

    def _begin_update(self, update: int) -> None:
        """The callbacks' `on_step_begin`, and a table of sample completions every `sample_generations_freq`."""
        self.control = self.callback_handler.on_step_begin(self.args, self.state, self.control)
        if self.args.num_sample_generations > 0 and (update - 1) % self.sample_generations_freq == 0:
            self.generate_completions(sampling=True)

    def _update_metrics(self, rollout, rewards, update_stats: dict, scores_per_reward: dict, trained, advantages):
        """The update's metrics over all processes, with the KL coefficient and learning rates it used, and the
        critic's explained variance on the episodes trained on (`trained`; value targets: `advantages.returns`),
        which `run.critic_watch` warns about once when it stays at about 0."""
        args, agents = self.args, self.agents
        turns = args.max_turns if agents is not None and args.max_turns > 1 else None  # per turn: multi-turn runs
        metrics = ({} if agents is None else agents.metrics(rollout, self.accelerator)) | update_metrics(
            rollout,
            rewards,
            update_stats,
            scores_per_reward,
            self.accelerator,
            self.processing_class.eos_token_id,
            self.stop_token_id,
            kl_coef=self.run.kl_coef,
            lr=self.lr_scheduler.get_last_lr()[0],
            report_shaped_scores=args.use_score_scaling or args.score_clip is not None,
            skipped_updates=self.run.skipped_updates if args.skip_nonfinite_updates else None,
            num_generations=args.num_generations,
        ) | critic_metrics(trained.values, advantages.returns, trained.response_mask, self.accelerator, turns)
        metrics |= critic.learning_rates(self.lr_scheduler)  # `lr_critic` with `critic_learning_rate`
        self.run.critic_watch.observe(metrics, self.state.global_step + 1, args.num_total_batches)
        return metrics

    # ---------------------------------------------------------------------------------------------- saving
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the policy (or its PEFT adapter) and tokenizer in the Hugging Face format; checkpoints and
        `save_value_model=True` also write a separate value model to `<output_dir>/value_model`. A shared value
        head is always written, as `value_head.safetensors` beside the policy. Outside checkpoints, a model card
        (README.md) too, and a SIGTERM/SIGINT that arrives meanwhile waits until the model is on disk, then exits
        with status 0."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if _internal_call:  # a checkpoint's part: the checkpoint guards the whole write
            return super().save_model(output_dir, _internal_call)
        with ckpt.PreemptionHandler() as preemption:
            super().save_model(output_dir)  # staged, verified, moved into place: whole or not at all
            if self.args.should_save:
                reporting.warn_on_failure("the model card", self._write_model_card, output_dir)
        if preemption.requested:
            logger.warning(f"{preemption.requested} during `save_model`: the model is saved in {output_dir}; exiting.")
            raise SystemExit(0)

    def _write_model_card(self, output_dir: str) -> None:
        dataset = self.model_card_dataset or f"{len(self.train_dataset or ())} prompts given as a `datasets.Dataset`"
        lm, history = self._models().wrapper.lm, self.state.log_history
        saving.write_model_card(output_dir, self.args, history, lm, self.rewards, dataset)

    def _write_models(self, folder: str, _internal_call: bool = False) -> None:
        """The policy (`Trainer.save_model` -> `_save`) and, in checkpoints or with `save_value_model`, the value
        model, into `folder`."""
        super()._write_models(folder, _internal_call)
        if _internal_call or self.args.save_value_model:
            saving.save_value_model(self._models(), os.path.join(folder, "value_model"), self.args.should_save)


__all__ = ["PPOTrainer"]

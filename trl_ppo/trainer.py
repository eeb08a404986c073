"""`PPOTrainer`: orchestration of the PPOv2 loop on top of `transformers.Trainer`.

One update reads like the algorithm: rollout -> score -> advantages -> PPO update -> log. The math is in
`ppo.py`, sampling in `rollout.py`, scoring in `rewards.py`, the optimisation of an update in `update.py`, model
plumbing in `models.py`; `step_api.py` runs the same pieces on episodes made outside the trainer.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers import (
    PreTrainedTokenizerBase,
    Trainer,
    TrainerCallback,
    TrainerState,
    TrainingArguments,
    set_seed,
)
from transformers.trainer_utils import TrainOutput
from transformers.utils import logging

from . import checkpoint as ckpt
from . import distributed as dist
from . import ppo
from .checkpoint import CheckpointingMixin
from .completions import CompletionsMixin
from .config import (
    OnPolicyConfig,
    PPOConfig,
    compute_batch_sizes,
    stop_and_penalty_tokens,
    validate_config,
)
from .data import LeftPaddingCollator, SharedOrderBatchSampler, fit_prompts, prepare_prompt_dataset
from .evaluation import EvaluationMixin
from .generation import resolve_backend
from .metrics import MetricsSinceLog, update_metrics
from .models import (
    PolicyAndValueWrapper,
    check_vocabularies,
    context_length,
    freeze,
    gradient_checkpointing_kwargs,
    is_peft_model,
    prepare_models,
    shared_parameters,
    with_value_function,
)
from .rewards import build_rewards, compute_scores, models_reading_policy_ids
from .rollout import Rollout, RolloutMixin
from .step_api import StepAPIMixin
from .update import PPOUpdateMixin

logger = logging.get_logger(__name__)


class PPOTrainer(
    StepAPIMixin, RolloutMixin, PPOUpdateMixin, EvaluationMixin, CompletionsMixin, CheckpointingMixin, Trainer
):
    """Train a causal LM policy with PPO against a reward, keeping it close to a reference policy.

    Args:
        args: a `PPOConfig`.
        processing_class: the policy's tokenizer (its pad token is required; prompts are left-padded).
        model: the policy, a causal LM.
        ref_model: the reference policy; `None` makes a frozen copy of `model`, or with PEFT uses `model` with
            its adapter disabled (no second copy of the weights).
        reward_model: a sequence-classification model with a scalar `score` head, a callable
            `f(prompts, completions, **columns) -> list[float | None]` (plain or async), or a list mixing them
            (combined with `args.reward_weights`).
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
    """

    _tag_names = ["trl_ppo", "ppo"]

    def __init__(
        self,
        args: PPOConfig,
        processing_class: PreTrainedTokenizerBase,
        model: nn.Module,
        ref_model: nn.Module | None,
        reward_model,
        train_dataset=None,
        value_model: nn.Module | None = None,
        data_collator=None,
        eval_dataset=None,
        optimizers: tuple = (None, None),
        callbacks: list[TrainerCallback] | None = None,
        peft_config=None,
        reward_processing_class=None,
    ) -> None:
        # Everything that can be checked without compute is checked first.
        if not isinstance(args, OnPolicyConfig):
            raise TypeError(f"`args` must be a `PPOConfig`, got {type(args).__name__}.")
        validate_config(args)
        if processing_class is None or processing_class.pad_token_id is None:
            raise ValueError(
                "The tokenizer has no pad token, which left-padding of prompts needs. Add one, e.g. "
                "`tokenizer.add_special_tokens({'pad_token': '[PAD]'})` (resize the model's embeddings if the "
                "new id is outside them) or `tokenizer.pad_token = tokenizer.eos_token`."
            )
        rewards = build_rewards(reward_model, args.reward_weights, reward_processing_class)
        model = with_value_function(model, value_model, args.seed)
        self.stop_token_id, self.penalty_token_id = stop_and_penalty_tokens(args, processing_class)
        fingerprints = {"policy": model, "ref_model": ref_model, "value_model": value_model}
        fingerprints.update({f"reward:{reward.name}": reward.source for reward in rewards if reward.is_model})
        fingerprints = {name: ckpt.model_fingerprint(module) for name, module in fingerprints.items()}
        model, ref_model = prepare_models(
            model,
            ref_model,
            value_model,
            [reward.source for reward in rewards],
            peft_config,
            gradient_checkpointing_kwargs(args),
        )
        self.is_peft_model = is_peft_model(model)
        check_vocabularies(
            processing_class,
            {"model": model, "ref_model": ref_model, "value_model": value_model, **models_reading_policy_ids(rewards)},
        )

        # Data.
        train_dataset = prepare_prompt_dataset(train_dataset, processing_class, args.dataset_num_proc)
        eval_dataset = prepare_prompt_dataset(eval_dataset, processing_class, args.dataset_num_proc)
        if train_dataset is not None and len(train_dataset) == 0:
            raise ValueError("`train_dataset` is empty: PPO needs prompts to sample from.")
        if args.eval_strategy == "epoch":
            raise ValueError(
                "`eval_strategy='epoch'` is not supported: PPO counts updates, not epochs. Use `eval_strategy='steps'` "
                "with `eval_steps` (in updates)."
            )
        if (args.eval_strategy != "no" or args.eval_on_start) and eval_dataset is None:
            strategy = getattr(args.eval_strategy, "value", args.eval_strategy)
            raise ValueError(
                f"`eval_strategy={strategy}` (or `eval_on_start`) evaluates on `eval_dataset`, and none was given: "
                "pass one, or set `eval_strategy='no'`."
            )
        if train_dataset is None and args.total_episodes is None:
            raise ValueError(
                "Without a `train_dataset` (the `step()` API), set `total_episodes`: it fixes the number of updates "
                "that the learning-rate schedule spans."
            )
        context = context_length(model)
        train_dataset = fit_prompts(
            train_dataset, args.max_prompt_length, args.response_length, context, "train_dataset"
        )
        eval_dataset = fit_prompts(eval_dataset, args.max_prompt_length, args.response_length, context, "eval_dataset")
        if data_collator is None:
            data_collator = LeftPaddingCollator(processing_class.pad_token_id)

        use_cache = getattr(model.config, "use_cache", None)
        # The `world_size` field shadows `TrainingArguments.world_size`, which DeepSpeed's set-up in `Trainer` reads.
        args.world_size = TrainingArguments.world_size.fget(args)
        super().__init__(
            model=PolicyAndValueWrapper(model, value_model),
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        if use_cache is not None:  # `Trainer` sets it from `args.use_cache`; keep the saved policy's own value
            model.config.use_cache = use_cache
        compute_batch_sizes(args, self.accelerator.num_processes, len(train_dataset or ()))
        self._run_identity = ckpt.run_identity(args, {})
        self._run_identity.update({f"{name}_fingerprint": value for name, value in fingerprints.items()})
        if train_dataset is not None and len(train_dataset) < args.batch_size:
            raise ValueError(
                f"`train_dataset` has {len(train_dataset)} prompts, fewer than one batch (`batch_size` = "
                f"{args.batch_size} = per_device_train_batch_size * gradient_accumulation_steps * world_size): "
                "add prompts or lower the batch size."
            )

        dist.check_supported(
            args,
            self.is_deepspeed_enabled,
            self.is_fsdp_enabled,
            dist.deepspeed_zero_stage(self.accelerator),
            ref_model is not None and bool(shared_parameters(ref_model, model)),
        )
        self.sampling_backend = resolve_backend(
            args.generation_backend,
            self.accelerator.device,
            dist.deepspeed_zero_stage(self.accelerator),
            self.is_peft_model,
        )
        self.rewards, self.reward_model = rewards, reward_model
        self.model_card_dataset: str | None = None  # what the model card calls the prompts (the CLI sets it)
        self.kl_coef = args.kl_coef  # moves under adaptive KL control (`kl_target`)
        self.score_moments = ppo.RunningMoments()  # of all scores so far, for `use_score_scaling`

        # Collate a few prompts now, so that a collator that pads on the wrong side fails before any rollout.
        if train_dataset is not None:
            self._prompts_of(self.data_collator([train_dataset[i] for i in range(min(len(train_dataset), 8))]))

        self.create_optimizer_and_scheduler(num_training_steps=args.num_total_batches)
        self.callback_handler.optimizer, self.callback_handler.lr_scheduler = self.optimizer, self.lr_scheduler
        dist.fit_deepspeed_batch_layout(self.accelerator, args.train_forward_batch_size, args.local_mini_batch_size)
        self.model, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)
        # Not given to `accelerator.prepare`: it would shard the batches a second time (the sampler already gives
        # each process its slice of every global batch); `_prompts_of` moves them to the device.
        self.train_dataloader = None if train_dataset is None else self.get_train_dataloader()
        self.model_wrapped = self.model
        if self.is_deepspeed_enabled:
            self.deepspeed = self.model  # `Trainer.save_model` / checkpointing read the engine from here

        # Frozen models (reference, reward models): on the device, or partitioned under ZeRO-3; never optimized.
        self._inference_engines = []  # ZeRO-3 engines whose hooks the frozen models need
        self.ref_model = None if ref_model is None else self._place_frozen(ref_model)
        for reward in rewards:
            if reward.is_model:
                reward.source = self._place_frozen(reward.source)

        # Every process samples with its own seed; the data order was fixed above from `seed` alone.
        set_seed(dist.process_seed(args.seed, self.accelerator.process_index))
        self.sample_generations_freq = max(1, args.num_total_batches // max(1, args.num_sample_generations))

    def _place_frozen(self, model: nn.Module) -> nn.Module:
        module, engine = dist.prepare_frozen_model(freeze(model), self.accelerator)
        if engine is not None:
            self._inference_engines.append(engine)
        return module

    def _build_accelerator_args(self, **kwargs) -> dict:
        """`Trainer`'s `Accelerator` arguments, plus the process group that `--ddp_backend` / `--ddp_timeout` ask
        for (`Trainer` passes them only to its own device setup, which DeepSpeed bypasses)."""
        accelerator_args = super()._build_accelerator_args(**kwargs)
        handler = dist.process_group_kwargs(self.args.ddp_backend, self.args.ddp_timeout)
        if handler is not None:
            accelerator_args["kwargs_handlers"] = [*accelerator_args.get("kwargs_handlers", []), handler]
        return accelerator_args

    # ------------------------------------------------------------------------------------------------ data
    def get_train_dataloader(self) -> DataLoader:
        """This process's batches of `local_batch_size` prompts, in a seeded order shared by all processes."""
        self._sampler = SharedOrderBatchSampler(
            len(self.train_dataset),
            self.args.local_batch_size,
            self.accelerator.num_processes,
            self.accelerator.process_index,
            self.args.data_seed if self.args.data_seed is not None else self.args.seed,
        )
        # Its own generator: starting an iterator draws a seed, which must not consume the global RNG (a resumed
        # run starts its iterator at another moment than the run it continues).
        return DataLoader(
            self.train_dataset,
            batch_sampler=self._sampler,
            collate_fn=self.data_collator,
            num_workers=self.args.dataloader_num_workers,
            generator=torch.Generator().manual_seed(self._sampler.seed),
        )

    def _batches_forever(self):
        """Batches from `self.data_position` = (epoch, batches already taken in it) on, advancing it."""
        while True:
            epoch, start = self.data_position
            self._sampler.epoch, self._sampler.start_batch = epoch, start
            for taken, batch in enumerate(self.train_dataloader, start=start + 1):
                self.data_position = (epoch, taken)
                yield batch
            self.data_position = (epoch + 1, 0)

    # ------------------------------------------------------------------------------------------- the loop
    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, **kwargs) -> TrainOutput:
        """Run the PPO updates: rollout -> score -> advantages -> update -> log (and checkpoint).

        `resume_from_checkpoint`: a checkpoint folder, or True for the newest complete one in `output_dir`.
        On SIGTERM/SIGINT the update in progress is finished (or, if its optimisation has not begun, dropped),
        a checkpoint is written and the process exits with status 0.
        """
        args = self.args
        if self.train_dataset is None:
            raise ValueError("`train()` samples from `train_dataset`, and none was given (use `step()` without one).")
        self._begin_training(self._checkpoint_to_resume(resume_from_checkpoint))
        if args.eval_on_start and self.state.global_step == 0:
            self.evaluate()
        batches = self._batches_forever()
        with ckpt.PreemptionHandler() as preemption:
            for update in range(self.state.global_step + 1, args.num_total_batches + 1):
                start_of_update = self._resume_point()
                self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
                if args.num_sample_generations > 0 and (update - 1) % self.sample_generations_freq == 0:
                    self.generate_completions(sampling=True)
                batch = next(batches)

                rollout = self.collect_rollout(batch)
                rollout.scores, scores_per_reward = self.score(rollout, batch)
                advantages, returns, reward_stats = self.compute_advantages(rollout)
                if self._stop_requested(preemption):
                    self._exit_after_checkpoint(preemption.requested, start_of_update)  # drops this rollout
                update_stats = self.ppo_update(rollout, advantages, returns)

                self._end_update(rollout, reward_stats, update_stats, scores_per_reward)
                if self._stop_requested(preemption):
                    self._exit_after_checkpoint(preemption.requested, None)
                if self.control.should_training_stop:
                    break
        return self._end_training()

    def score(self, rollout: Rollout, batch: dict) -> tuple[torch.Tensor, dict]:
        """Scores `[B]` (weighted sum of the rewards, minus `missing_eos_penalty` for responses without the stop
        token) and, per reward name, `(scores [B], present [B] or None)`."""
        columns = {key: value for key, value in batch.items() if key not in ("input_ids", "attention_mask")}
        with self.accelerator.autocast(), _name_the_update(self.state.global_step + 1):
            return compute_scores(
                self.rewards,
                rollout,
                self.processing_class,
                columns,
                self.args.local_rollout_forward_batch_size,
                self.penalty_token_id,
                self.args.missing_eos_penalty,
            )

    def compute_advantages(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """KL-penalised per-token rewards -> GAE advantages (whitened) and returns, all `[B, T]`."""
        args = self.args
        mask = rollout.response_mask
        kl = self.per_token_kl(rollout)
        scores = self._shaped_scores(rollout.scores)
        rewards, non_score_rewards = ppo.per_token_rewards(scores, kl, mask, self.kl_coef)
        if args.whiten_rewards:
            rewards = ppo.masked_whiten(rewards, mask, shift_mean=False).masked_fill(~mask, 0.0)
        advantages, returns = ppo.compute_gae(rewards, rollout.values, mask, args.gamma, args.lam)
        advantages = ppo.masked_whiten(advantages, mask).masked_fill(~mask, 0.0)
        return advantages, returns, {"kl": kl, "non_score_rewards": non_score_rewards, "shaped_scores": scores}

    def per_token_kl(self, rollout: Rollout) -> torch.Tensor:
        """The per-token KL penalty term `[B, T]` of `kl_penalty` (with `kl_estimator`), zero on padding."""
        args = self.args
        if args.kl_penalty == "full":
            kl = rollout.full_kl
        else:
            kl = ppo.kl_penalty(rollout.logprobs, rollout.ref_logprobs, args.kl_penalty, args.kl_estimator)
        return kl.masked_fill(~rollout.response_mask, 0.0)

    def _shaped_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores as the rewards use them: scaled by the running moments (updated with this update's scores from
        all processes) and clipped, as `use_score_scaling`, `use_score_norm` and `score_clip` say."""
        args = self.args
        if args.use_score_scaling:
            self.score_moments.update(self.accelerator.gather(scores.float()))
        moments = self.score_moments
        return ppo.shape_scores(
            scores, moments.mean, moments.std, args.use_score_scaling, args.use_score_norm, args.score_clip
        )

    # ------------------------------------------------------------------------------------- state and logging
    def _begin_training(self, checkpoint: str | None) -> None:
        args = self.args
        earlier_logs = self.state.log_history  # e.g. an `evaluate()` before training: kept in a fresh run
        self.state = TrainerState(stateful_callbacks=self._exportable_callbacks())
        if checkpoint is None:
            self.state.log_history = earlier_logs
        self.state.episode = 0
        self.data_position = (0, 0)
        self._metrics_since_log = MetricsSinceLog()
        self._policy_loss_sum = 0.0
        self._skipped_updates = 0
        self._last_checkpoint = None
        self.kl_coef = args.kl_coef
        self.score_moments = ppo.RunningMoments()
        if checkpoint is not None:
            self._restore_checkpoint(checkpoint)
        epochs = args.total_episodes / len(self.train_dataset) if self.train_dataset is not None else 1.0
        self.state.init_training_references(self, args.num_total_batches, epochs, None)
        self.state.compute_steps(args, args.num_total_batches)
        self._start_time, self._start_episode = time.time(), self.state.episode
        self.model.train()
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        self._training_active = True

    def _end_update(self, rollout: Rollout, reward_stats: dict, update_stats: dict, scores_per_reward: dict) -> dict:
        """Count the episodes, gather this update's metrics, adapt the KL coefficient, step the schedule, then
        log / save as the callbacks decide. Returns the update's metrics."""
        args = self.args
        self.state.episode += args.batch_size
        metrics = update_metrics(
            rollout,
            reward_stats["kl"],
            reward_stats["non_score_rewards"],
            update_stats,
            scores_per_reward,
            self.accelerator,
            self.processing_class.eos_token_id,
            self.stop_token_id,
        )
        if args.use_score_scaling or args.score_clip is not None:
            metrics["objective/shaped_scores"] = self.accelerator.gather(reward_stats["shaped_scores"]).mean().item()
        metrics["objective/kl_coef"] = self.kl_coef  # the coefficient this update's rewards used
        if args.kl_target is not None:
            self.kl_coef = ppo.adaptive_kl_coef(
                self.kl_coef, metrics["objective/kl"], args.kl_target, args.kl_horizon, args.batch_size
            )
        metrics["eps"] = int((self.state.episode - self._start_episode) / max(time.time() - self._start_time, 1e-9))
        metrics["lr"] = self.lr_scheduler.get_last_lr()[0]
        metrics["episode"] = self.state.episode
        if args.skip_nonfinite_updates:
            metrics["loss/skipped_updates"] = self._skipped_updates
        self._metrics_since_log.add(metrics)
        self._policy_loss_sum += metrics.get("loss/policy_avg", 0.0)  # absent when the update was skipped
        self.state.global_step += 1
        self.state.epoch = self.state.episode / len(self.train_dataset) if self.train_dataset is not None else 0.0
        self.lr_scheduler.step()
        self.control = self.callback_handler.on_step_end(args, self.state, self.control)
        self._show_progress(metrics)
        if self.control.should_log:
            self.log(self._metrics_since_log.pop())
        if self.control.should_evaluate:  # before saving: the checkpoint's RNG state is then after the evaluation
            self.evaluate()
        if self.control.should_save:
            self._save_checkpoint(self.model, trial=None)
            self.control = self.callback_handler.on_save(args, self.state, self.control)
        return metrics

    def _show_progress(self, metrics: dict) -> None:
        """Episodes, episodes/s, score and KL of the last update beside the progress bar (`ProgressCallback`'s)."""
        for callback in self.callback_handler.callbacks:
            bar = getattr(callback, "training_bar", None)
            if bar is not None:
                bar.set_postfix(
                    episode=metrics["episode"],
                    eps=metrics["eps"],
                    score=f"{metrics['objective/scores']:.3g}",
                    kl=f"{metrics['objective/kl']:.3g}",
                )

    def _end_training(self) -> TrainOutput:
        self._training_active = False
        if self._metrics_since_log:
            self.log(self._metrics_since_log.pop())
        if self.args.should_save:  # the run's log and its curves, for `trl-ppo plot` and people
            from .reporting import PLOT_FILE, plot_curves

            os.makedirs(self.args.output_dir, exist_ok=True)
            self.state.save_to_json(os.path.join(self.args.output_dir, "trainer_state.json"))
            plot_curves(self.state.log_history, os.path.join(self.args.output_dir, PLOT_FILE))
        self.control = self.callback_handler.on_train_end(self.args, self.state, self.control)
        if self.control.should_save:
            self._save_checkpoint(self.model, trial=None)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)
        runtime = time.time() - self._start_time
        metrics = {
            "train_runtime": runtime,
            "train_episodes_per_second": (self.state.episode - self._start_episode) / max(runtime, 1e-9),
            "total_episodes": self.state.episode,
        }
        loss = self._policy_loss_sum / max(self.state.global_step, 1)
        return TrainOutput(self.state.global_step, loss, metrics)


@contextlib.contextmanager
def _name_the_update(update: int):
    """Prefix a reward error with the update it happened in."""
    try:
        yield
    except ValueError as error:
        raise ValueError(f"Update {update}: {error}") from error


__all__ = ["PPOTrainer"]

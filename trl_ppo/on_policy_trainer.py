"""`OnPolicyTrainer`: a `transformers.Trainer` whose training loop is the subclass's own (`PPOTrainer.train`),
and everything such a loop needs besides its algorithm: the run's mutable state (`RunState`) created, counted,
logged and checkpointed; resuming; preemption; the per-process data order; saving the policy.

It reads only what it defines itself or what `transformers.Trainer` defines, and a subclass uses it through
`run`, `state`, `_begin_training`, `_end_update`, `_end_training` and the checkpoint methods.
"""

from __future__ import annotations

import time
import weakref

from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import TrainOutput
from transformers.utils import logging

from . import checkpoint as ckpt
from . import data, reporting, saving
from . import distributed as dist
from .checkpoint.trainer_files import exportable_callbacks, restore_trainer_checkpoint, write_trainer_checkpoint
from .checkpoint.weights import named_weights
from .config_checks import compute_batch_sizes, samples_per_prompt
from .deadlines import take_counts
from .metrics import episodes_per_second
from .models import PreparedModels
from .run_state import PPOTrainerState, RunState

logger = logging.get_logger(__name__)


class OnPolicyTrainer(Trainer):
    """`transformers.Trainer` for on-policy RL: the subclass writes the updates, this class keeps their books."""

    def __init__(
        self,
        args,
        tokenizer,
        wrapper,
        train_dataset,
        eval_dataset,
        collator,
        callbacks,
        optimizers,
        fingerprints,
        reward_names=(),
    ):
        """`Trainer.__init__` with `wrapper` (the trained models as one module) as its model; then the batch sizes,
        which need the number of processes it found, a fresh `PPOTrainerState` and `RunState`, and the run's
        identity for resuming (the batch layout, the initial models' `fingerprints`, the settings and the names of
        the rewards)."""
        use_cache = getattr(wrapper.config, "use_cache", None)
        # The `world_size` field shadows `TrainingArguments.world_size`, which DeepSpeed's set-up in `Trainer` reads.
        args.world_size = TrainingArguments.world_size.fget(args)
        super().__init__(
            model=wrapper,
            args=args,
            data_collator=collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        reporting.numeric_log_lines(self)
        if use_cache is not None:  # `Trainer` sets it from `args.use_cache`; keep the saved policy's own value
            wrapper.config.use_cache = use_cache
        # The update scales its losses itself (`update.backward_scale`); some transformers versions (5.5.0, for
        # one) build the Accelerator with `gradient_accumulation_steps`, whose `backward` would divide again.
        self.accelerator.gradient_accumulation_steps = 1
        # accelerate has no fp16 autocast on a CPU (DeepSpeed casts the model itself)
        if (args.fp16 or args.bf16) and not (self.accelerator.native_amp or self.is_deepspeed_enabled):
            logger.warning(
                f"`{'fp16' if args.fp16 else 'bf16'}=True` has no effect on {self.accelerator.device}: accelerate "
                "enables no autocast there, so this run computes in float32. On a CPU, use `bf16=True` with "
                "`use_cpu=True` for bfloat16 autocast, or leave the precision flags off."
            )
        compute_batch_sizes(args, self.accelerator.num_processes, len(train_dataset or ()))
        data.check_one_batch(train_dataset, args.batch_size, samples_per_prompt(args))
        self.state = self._new_trainer_state()
        self._new_run_state()
        self._run_identity = ckpt.run_identity(args, fingerprints, reward_names)
        self._training_active = False
        self._train_ended = False  # `train()` returned: a `step()` after it goes on with its run

    def _build_accelerator_args(self, **kwargs) -> dict:
        """`Trainer`'s `Accelerator` arguments, plus the process group that `--ddp_backend` / `--ddp_timeout` ask
        for (`Trainer` passes them only to its own device setup, which DeepSpeed bypasses). Overrides a private
        method of `Trainer`, as no public hook exists; checked against transformers 5.23."""
        accelerator_args = super()._build_accelerator_args(**kwargs)
        handler = dist.process_group_kwargs(self.args.ddp_backend, self.args.ddp_timeout)
        if handler is not None:
            accelerator_args["kwargs_handlers"] = [*accelerator_args.get("kwargs_handlers", []), handler]
        return accelerator_args

    def get_train_dataloader(self):
        """This process's batches of `local_batch_size` prompts, in a seeded order shared by all processes."""
        accelerator = self.accelerator
        loader, self._sampler = data.shared_order_loader(
            self.train_dataset, self.args, self.data_collator, accelerator.num_processes, accelerator.process_index
        )
        return loader

    def _models(self) -> PreparedModels:
        """The trained model as prepared (and no reference: a subclass with one overrides this)."""
        return PreparedModels(self.accelerator, self.model, None)

    # -------------------------------------------------------------------------------------- bookkeeping
    def _new_run_state(self, run_id: str | None = None) -> None:
        """The one place a run's mutable state is created (at construction, and afresh by each `train()`)."""
        self.run = RunState(kl_coef=self.args.kl_coef, run_id=run_id)

    def _new_trainer_state(self, log_history: list | None = None) -> PPOTrainerState:
        return PPOTrainerState(
            is_local_process_zero=self.is_local_process_zero(),
            is_world_process_zero=self.is_world_process_zero(),
            stateful_callbacks=exportable_callbacks(self),
            log_history=log_history or [],
        )

    def _start_run(self, resume_from_checkpoint: str | bool | None) -> None:
        """Begin a run of `train()` or `step()`: fresh (None; `output_dir` must hold no checkpoint, unless
        `overwrite_output_dir`) or resumed (a checkpoint, or True for the newest in `output_dir`; "auto": the newest
        if there is one, else fresh), holding the run
        lock of `output_dir` (`checkpoint.run_lock`)."""
        args = self.args
        start = ckpt.start_checkpoint(
            args.output_dir, resume_from_checkpoint, self.accelerator, self._run_identity, args.overwrite_output_dir
        )
        # `train()` releases the run lock at its end; a run driven by `step()` holds it while its trainer lives
        weakref.finalize(self, ckpt.release_run_lock, args.output_dir)
        self._begin_training(start)

    def _begin_training(self, start: ckpt.RunStart) -> None:
        """A fresh run state and trainer state, or those of `start.checkpoint`; then the callbacks'
        `on_train_begin`."""
        args, checkpoint = self.args, start.checkpoint
        self._train_ended = False
        take_counts()  # calls timed out or retried before this run (another trainer's, in this process) are not its
        earlier_logs = self.state.log_history  # e.g. an `evaluate()` before training: kept in a fresh run
        self._new_run_state(start.run_id)
        self.state = self._new_trainer_state(earlier_logs if checkpoint is None else None)
        if checkpoint is not None:
            self._restore_checkpoint(checkpoint)
        epochs = self._epochs(args.total_episodes)
        self.state.init_training_references(self, args.num_total_batches, epochs, None)
        self.state.compute_steps(args, args.num_total_batches)
        self._set_going()

    def _begin_step_run(self) -> None:
        """Before a `step()` or `save_checkpoint()` outside a run: begin a fresh run, or, where this trainer's
        `train()` has ended, let that run go on, with its run id, counters and checkpoints (a fresh run would be
        refused over them, or with `overwrite_output_dir` delete them)."""
        if self._training_active:
            return
        if self._train_ended:
            self._set_going()
        else:
            self._start_run(None)

    def _epochs(self, episodes: int) -> float:
        """Passes over `train_dataset` that `episodes` make (each prompt `num_generations` episodes); 1.0 without
        one."""
        if self.train_dataset is None:
            return 1.0
        return episodes / (len(self.train_dataset) * samples_per_prompt(self.args))

    def _set_going(self) -> None:
        """The clock of `eps`, training mode and the callbacks' `on_train_begin`, as updates begin."""
        self._start_time, self._start_episode = time.time(), self.state.episode
        self.model.train()
        self.control = self.callback_handler.on_train_begin(self.args, self.state, self.control)
        self._training_active = True

    def _end_update(self, metrics: dict) -> dict:
        """Count the update and its episodes, then log / evaluate / save as the callbacks decide. -> `metrics`
        with `episode` and `eps` added."""
        args, state = self.args, self.state
        state.episode += args.batch_size
        state.global_step += 1
        state.epoch = self._epochs(state.episode) if self.train_dataset is not None else 0.0
        metrics["eps"] = episodes_per_second(state.episode - self._start_episode, time.time() - self._start_time)
        metrics["episode"] = state.episode
        self.run.metrics_since_log.add(metrics)
        self.run.policy_loss_sum += metrics.get("loss/policy_avg", 0.0)  # absent when the update was skipped
        self.control = self.callback_handler.on_step_end(args, state, self.control)
        reporting.show_progress(self.callback_handler.callbacks, metrics)
        if self.control.should_log:
            self.log(self.run.metrics_since_log.pop())
        if self.control.should_evaluate:  # before saving: the checkpoint's RNG state is then after the evaluation
            self.evaluate()
        if self.control.should_save:
            self._write_checkpoint()
            self.control = self.callback_handler.on_save(args, state, self.control)
        return metrics

    def _end_training(self) -> TrainOutput:
        self._training_active, self._train_ended = False, True
        if self.run.metrics_since_log:
            self.log(self.run.metrics_since_log.pop())
        if self.args.should_save:  # reporting: a failure (a full disk) must not cost the trained model
            reporting.warn_on_failure(
                "the run's log and curves", reporting.save_run_log, self.args.output_dir, self.state
            )
        self.control = self.callback_handler.on_train_end(self.args, self.state, self.control)
        if self.control.should_save:
            self._write_checkpoint()
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)
        runtime, episodes_run = time.time() - self._start_time, self.state.episode - self._start_episode
        metrics = {
            "train_runtime": runtime,
            "train_episodes_per_second": episodes_run / max(runtime, 1e-9),
            "total_episodes": self.state.episode,
        }
        return TrainOutput(self.state.global_step, self.run.policy_loss_sum / max(self.state.global_step, 1), metrics)

    # ------------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> str:
        """Write `checkpoint-<update>` of a run driven by `step()` now (weights, optimizer, scheduler, run state
        with the KL coefficient and score moments, RNG) -> its path. `train()` saves by `save_strategy` itself.
        Refused where `output_dir` holds another run's checkpoints (`checkpoint.ownership`). After `train()`, a
        checkpoint of that run as of now."""
        self._begin_step_run()
        return self._write_checkpoint()

    def load_checkpoint(self, checkpoint: str | bool = True) -> int:
        """Continue a run driven by `step()` from `checkpoint` (a folder, True for the newest complete one in
        `output_dir`, or "auto": that one if there is one, else a fresh run): the next `step()` is then the update
        after it. -> the number of updates it had done."""
        if checkpoint in (None, False):
            raise ValueError("`load_checkpoint` needs a checkpoint folder, or True for the newest in `output_dir`.")
        self._start_run(checkpoint)
        return self.state.global_step

    def _write_checkpoint(self, resume_point: ckpt.ResumePoint | None = None) -> str:
        """`checkpoint-<update>` of the run as of now, or with an earlier `resume_point` (a dropped rollout)."""
        resume_point = resume_point if resume_point is not None else ckpt.ResumePoint.capture(self.run)
        path = write_trainer_checkpoint(self, resume_point, self._run_identity)
        self.run.last_checkpoint = (self.state.global_step, path)
        logger.info(f"Checkpoint of update {self.state.global_step} written to {path}")
        return path

    def _restore_checkpoint(self, path: str) -> None:
        """Weights, optimizer, scheduler, trainer state, callbacks, run state and RNG of checkpoint `path`."""
        self.state = restore_trainer_checkpoint(self, self.run, path, self._run_identity)
        logger.warning(f"Resuming from {path}: update {self.state.global_step}, episode {self.state.episode}.")

    def _exit_after_checkpoint(self, signal_name: str | None, resume_point: ckpt.ResumePoint | None) -> None:
        step, last = self.state.global_step, self.run.last_checkpoint
        path = last[1] if last is not None and last[0] == step else self._write_checkpoint(resume_point)
        # `trl-ppo` sets `resume_hint` to the command that resumes this run (`output_dirs.resume_command`)
        resume = getattr(self, "resume_hint", None) or "`train(resume_from_checkpoint=True)`."
        logger.warning(
            f"Stopped by {signal_name or 'a signal'} after update {step} of {self.args.num_total_batches}; "
            f"checkpoint: {path}. Resume with {resume}"
        )
        raise SystemExit(0)

    # ---------------------------------------------------------------------------------------------- saving
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """`Trainer.save_model`, after every process has checked the weights finite (`saving.check_finite_weights`),
        written whole or not at all: staged in `output_dir`, verified, then moved into place (`_write_models`,
        `saving.save_atomically`). A checkpoint (`_internal_call`) checks and stages its whole folder itself."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if _internal_call:
            return self._write_models(output_dir, _internal_call=True)
        weights = named_weights(self.accelerator.unwrap_model(self.model))
        saving.check_finite_weights(self.accelerator, weights, output_dir)
        needed = saving.parameter_bytes(self.accelerator.unwrap_model(self.model))
        saving.save_atomically(output_dir, self._write_models, self.args.should_save, needed)

    def _write_models(self, folder: str, _internal_call: bool = False) -> None:
        """What `save_model` writes into `folder`: the policy, through `Trainer.save_model` (-> `_save`); under FSDP2
        gathered whole (on the main process; a collective), whatever `fsdp_state_dict_type` says: `Trainer` writes
        nothing here for a sharded one (a checkpoint keeps the shards beside the optimizer)."""
        if self._models().is_fsdp2:
            self._save(folder, state_dict=self.accelerator.get_state_dict(self.model))
            return
        super().save_model(folder, _internal_call=_internal_call)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Overrides `Trainer._save` (private: `Trainer.save_model` calls it, no public hook exists; checked
        against transformers 5.23), which would save the policy-and-value wrapper as one model."""
        if self.args.should_save:
            output_dir = output_dir if output_dir is not None else self.args.output_dir
            saving.save_policy(self._models(), self.processing_class, self.args, output_dir, state_dict)

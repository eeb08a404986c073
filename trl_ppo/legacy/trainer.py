"""`PPOTrainer` of TRL's first API (trl <= 0.11): the user owns the loop (`generate` → score → `step`), the
trainer owns the optimisation. An adapter: every update runs through `trl_ppo.PPOTrainer.update_on_episodes`
(the same pieces as `trl_ppo`'s own `step()` and `train()`), and this class keeps trl 0.11's signatures, checks,
attributes and stats.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import time
import warnings
from collections.abc import Callable

import torch
from accelerate.scheduler import AcceleratedScheduler
from transformers import PreTrainedTokenizerBase, set_seed
from transformers.trainer_callback import PrinterCallback

from .. import distributed as dist
from .. import step_api as episodes
from ..checkpoint.weights import named_weights
from ..completions import log_table_to_wandb
from ..models import context_length
from ..saving import check_finite_weights, parameter_bytes, save_atomically
from ..trainer import PPOTrainer as CorePPOTrainer
from ..value_head import check_save_directory, is_value_head_model
from .config import PPOConfig, core_config
from .models import create_reference_model
from .stats import scalar_stats, step_stats


class KLController:
    """`ppo_trainer.kl_ctl`: its `value` is the run's current KL coefficient (read and set; a value set before the
    first `step()` is the one that step uses, as in trl 0.11)."""

    def __init__(self, trainer: CorePPOTrainer) -> None:
        self._trainer = trainer

    @property
    def value(self) -> float:
        return self._trainer.run.kl_coef

    @value.setter
    def value(self, coef: float) -> None:
        value = float(coef) if isinstance(coef, (int, float, torch.Tensor)) and not isinstance(coef, bool) else None
        if value is None or not math.isfinite(value) or value < 0:
            raise ValueError(f"`kl_ctl.value` (the KL coefficient) must be a finite number >= 0, got {coef!r}.")
        self._trainer.run.kl_coef = value


class PPOTrainer:
    """trl 0.11's `PPOTrainer(config, model, ref_model, tokenizer, ...)`.

    `model`: an `AutoModelForCausalLMWithValueHead`; `ref_model`: one too, or None for a frozen copy of `model`
    (sharing its first `num_shared_layers` blocks, frozen in both) or, under PEFT, `model` with its adapter
    disabled. `optimizer`: default Adam on the trainable parameters at `config.learning_rate`; `lr_scheduler`
    is stepped after each `step()`. `dataset` with `data_collator` gives `dataloader` (batches of
    `config.batch_size`, shuffled, the last incomplete one dropped). `training_data_collator` is accepted and
    not needed: trl_ppo pads episodes itself.
    """

    def __init__(
        self,
        config: PPOConfig | None = None,
        model=None,
        ref_model=None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        dataset=None,
        optimizer: torch.optim.Optimizer | None = None,
        data_collator: Callable | None = None,
        num_shared_layers: int | None = None,
        lr_scheduler=None,
        training_data_collator: Callable | None = None,
    ) -> None:
        check_constructor_inputs(config, model, ref_model, tokenizer, dataset, lr_scheduler)
        set_seed(config.seed)
        self.config, self.tokenizer, self.model = config, tokenizer, model
        self.is_peft_model = model.is_peft_model
        ref_model = reference_model(model, ref_model, num_shared_layers)
        if optimizer is None:
            trainable = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.Adam(trainable, lr=config.learning_rate)
        if config.push_to_hub_if_best_kwargs:
            warnings.warn("`push_to_hub_if_best_kwargs` is not supported by trl_ppo: nothing is pushed.", stacklevel=2)
        if config.log_with == "wandb":
            os.environ.setdefault("WANDB_PROJECT", config.tracker_project_name)
        if config.log_with == "tensorboard" and "logging_dir" in config.project_kwargs:  # where trl 0.11 wrote
            logging_dir = os.path.join(config.project_kwargs["logging_dir"], config.tracker_project_name)
            os.environ.setdefault("TENSORBOARD_LOGGING_DIR", logging_dir)
        stop_token = "eos" if tokenizer.eos_token_id is not None else None
        self.trainer = CorePPOTrainer(
            args=core_config(config, stop_token),
            processing_class=tokenizer,
            model=model,
            ref_model=ref_model,
            optimizers=(optimizer, lr_scheduler),
        )
        self.trainer.remove_callback(PrinterCallback)  # trl 0.11 printed no logs
        self.accelerator = self.trainer.accelerator
        self.ref_model = self.trainer.ref_model if ref_model is not None else None
        self.optimizer = self.trainer.optimizer
        self.lr_scheduler = None if lr_scheduler is None else AcceleratedScheduler(lr_scheduler, self.optimizer)
        self.kl_ctl = KLController(self.trainer)
        self.current_device = self.accelerator.device
        self.is_distributed = self.accelerator.num_processes > 1
        self.is_encoder_decoder = False
        config.world_size = self.accelerator.num_processes
        config.global_backward_batch_size = config.backward_batch_size * config.world_size
        config.global_batch_size = config.batch_size * config.world_size
        config.is_encoder_decoder, config.is_peft_model = False, self.is_peft_model
        self.current_step = 0
        self.dataset = dataset
        self.dataloader = None if dataset is None else self.prepare_dataloader(dataset, data_collator)
        if dataset is None:
            warnings.warn("No dataset is provided: `dataloader` is None; pass your own batches to `step()`.")

    # --------------------------------------------------------------------------------------------- data
    def prepare_dataloader(self, dataset, data_collator=None) -> torch.utils.data.DataLoader:
        """Batches of `config.batch_size` from `dataset`, shuffled, the last incomplete one dropped (a dataset
        shorter than one batch is refused); a `datasets.Dataset` loses the columns the model does not read (keeping
        `query`, `response`, `label`)."""
        from datasets import Dataset

        if hasattr(dataset, "__len__") and len(dataset) < self.config.batch_size:
            raise ValueError(
                f"`dataset` has {len(dataset)} rows, fewer than one batch (`batch_size` = {self.config.batch_size}): "
                "the dataloader drops the last incomplete batch (as trl 0.11's did), so it would have no batch at "
                "all. Add rows or lower `batch_size`."
            )
        if isinstance(dataset, Dataset) and self.config.remove_unused_columns:
            kept = set(inspect.signature(self.model.forward).parameters) | {"label", "query", "response"}
            dataset = dataset.remove_columns([name for name in dataset.column_names if name not in kept])
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=self.config.batch_size, collate_fn=data_collator, shuffle=True, drop_last=True
        )
        return self.accelerator.prepare(loader)

    # --------------------------------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(
        self,
        query_tensor: torch.Tensor | list[torch.Tensor],
        length_sampler: Callable[[], int] | None = None,
        batch_size: int = 4,
        return_prompt: bool = True,
        generate_ref_response: bool = False,
        remove_padding: bool = True,
        **generation_kwargs,
    ):
        """Responses to one query (1-D ids -> `[1, L]`) or a list of them (-> a list of 1-D tensors, cut after the
        EOS token unless `remove_padding=False`), sampled `batch_size` at a time with trl_ppo's sampler; with
        `generate_ref_response`, also the reference's responses: `(responses, ref_responses)`."""
        single = isinstance(query_tensor, torch.Tensor)
        if single and query_tensor.dim() != 1:
            raise ValueError(
                "query_tensor must be a tensor of shape (`seq_len`) or a list of tensors of shape (`seq_len`)"
            )
        queries = episodes.check_token_lists([query_tensor] if single else list(query_tensor), "query_tensor")
        generation_kwargs.setdefault("max_new_tokens", self.trainer.args.response_length)
        limits = (self.trainer.vocabulary_size, context_length(self.model), self.tokenizer.pad_token_id)
        max_new_tokens = None if length_sampler else generation_kwargs["max_new_tokens"]  # else checked per draw
        request = (queries, batch_size, max_new_tokens, *limits, generation_kwargs)
        dist.checked_on_every_process(lambda: episodes.check_generation_request(*request), self.accelerator.device,
                                      "`generate()` queries")
        options = (length_sampler, batch_size, return_prompt, remove_padding, generation_kwargs)
        responses = self._sample(queries, False, *options)
        ref_responses = self._sample(queries, True, *options) if generate_ref_response else None
        if single:
            responses = responses[0].unsqueeze(0)
            ref_responses = ref_responses[0].unsqueeze(0) if ref_responses is not None else None
        return (responses, ref_responses) if generate_ref_response else responses

    def _sample(self, queries, reference, length_sampler, batch_size, return_prompt, remove_padding, kwargs) -> list:
        """`batch_size` queries at a time (one length drawn per batch) from the policy or the `reference`; without
        `remove_padding` each batch's responses are right-padded to its longest, as `generate` returned them."""
        results = []
        for start in range(0, len(queries), batch_size):
            part = queries[start : start + batch_size]
            responses = self.trainer.generate(
                part, return_prompt, len(part), length_sampler, reference=reference, **kwargs
            )
            if not remove_padding:
                width, pad = max(r.numel() for r in responses), self.tokenizer.pad_token_id
                responses = [torch.nn.functional.pad(r, (0, width - r.numel()), value=pad) for r in responses]
            results.extend(responses)
        return results

    # -------------------------------------------------------------------------------------------- step
    def _check_step(self, queries, responses, scores, response_masks) -> tuple:
        scores = check_step_inputs(self.config.batch_size, queries, responses, scores, response_masks)
        episodes.require_pad_token(self.tokenizer.pad_token_id, "`step()` (it pads queries and responses)")
        queries = episodes.check_token_lists(queries, "queries")
        responses = episodes.check_token_lists(responses, "responses")
        episodes.check_episode_token_ids(queries, responses, self.trainer.vocabulary_size)
        episodes.check_episode_lengths(queries, responses, context_length(self.model))
        pad = self.tokenizer.pad_token_id
        for index, query in enumerate(queries):  # as core `step()` refuses it: nothing to condition on
            if bool((query == pad).all()):
                raise ValueError(
                    f"`queries[{index}]` is made only of pad ids ({pad}): give each query's own tokens (e.g. "
                    "`tokenizer(text, return_tensors='pt').input_ids[0]`)."
                )
        return queries, responses, scores, episodes.check_response_masks(response_masks, responses)

    def step(self, queries: list, responses: list, scores: list, response_masks: list | None = None) -> dict:
        """One PPO optimisation on `config.batch_size` episodes: `queries` and `responses` lists of 1-D token ids,
        `scores` a list of 0-d (or one-element) tensors; `response_masks` leaves response tokens out of training.
        -> trl 0.11's stats (`legacy.stats`)."""
        started = time.time()
        check = functools.partial(self._check_step, queries, responses, scores, response_masks)
        queries, responses, scores, response_masks = dist.checked_on_every_process(
            check, self.accelerator.device, "`step()` episodes"  # one process's bad episodes stop them all, no hang
        )
        self._begin_run()
        outcome = self.trainer.update_on_episodes(queries, responses, scores, response_masks, detailed=True)
        return step_stats(outcome, queries, responses, self.config.vf_coef, self.accelerator, started)

    def log_stats(self, stats: dict, batch: dict, rewards, columns_to_log=("query", "response")) -> None:
        """Log `stats` (their scalars), `env/reward_mean` and `env/reward_std` to the trackers of `log_with`, and
        with wandb a `game_log` table of the batch's `columns_to_log` and each reward."""
        columns_to_log = list(columns_to_log)
        episodes.check_rewards_match_batch(rewards, batch, columns_to_log, self.config.batch_size)
        rewards = episodes.scores_tensor(rewards, "`log_stats()`'s `rewards`")
        rewards = self.accelerator.gather(rewards.to(self.current_device)).cpu()
        if self.config.log_with == "wandb" and any(column not in batch for column in columns_to_log):
            raise ValueError(f"Columns to log {columns_to_log} are not present in the batch {list(batch)}.")
        if "query" not in batch and "response" not in batch:
            warnings.warn("The game logs will not be logged: the batch has no 'query' or 'response' column.")
        elif self.config.log_with == "wandb" and self.accelerator.is_main_process:
            rows = episodes.episode_rows(batch, rewards, columns_to_log, self.tokenizer)
            log_table_to_wandb(rows, step=self.trainer.state.global_step, key="game_log")
        logs = scalar_stats(stats)
        logs["env/reward_mean"] = rewards.mean().item()
        logs["env/reward_std"] = rewards.std().item() if rewards.numel() > 1 else 0.0
        self.current_step += 1
        if self.config.log_with is not None:
            self.trainer.log(logs)

    # ------------------------------------------------------------------------------- saving and resuming
    def save_pretrained(self, save_directory: str) -> None:
        """The policy with its value head (trl 0.11's format, see `AutoModelForCausalLMWithValueHead`) and the
        tokenizer. Under DeepSpeed the weights are gathered first (every process must call this)."""
        check_save_directory(save_directory)
        check_finite_weights(self.accelerator, named_weights(self.accelerator.unwrap_model(self.model)), save_directory)
        state_dict = None
        if dist.deepspeed_zero_stage(self.accelerator) is not None:
            state_dict = self.accelerator.get_state_dict(self.trainer.model)
            state_dict = {k[len("policy.") :]: v for k, v in (state_dict or {}).items() if k.startswith("policy.")}
        if self.accelerator.is_main_process:  # staged, verified, moved into place: whole or not at all
            model = self.accelerator.unwrap_model(self.model)

            def write(folder: str) -> None:
                model.save_pretrained(folder, state_dict=state_dict)
                self.tokenizer.save_pretrained(folder)

            save_atomically(save_directory, write, needed_bytes=parameter_bytes(model))

    def save_checkpoint(self) -> str:
        """Write `<config.output_dir>/checkpoint-<steps>`: the model and value head, optimizer, scheduler, KL
        coefficient, score statistics and RNG states -> its path. (trl 0.11 had no way to resume a run.)"""
        self._begin_run()
        return self.trainer.save_checkpoint()

    def _begin_run(self) -> None:
        """Begin the core trainer's run before the first update or checkpoint, keeping the KL coefficient the script
        may have set through `kl_ctl.value` (beginning a run starts from `init_kl_coef` otherwise)."""
        if not self.trainer._training_active:
            kl_coef = self.kl_ctl.value
            self.trainer._begin_step_run()
            self.kl_ctl.value = kl_coef

    def load_checkpoint(self, checkpoint: str | bool = True) -> int:
        """Continue from a `save_checkpoint()` folder (True: the newest in `config.output_dir`) -> the number of
        `step()`s it had done; skip as many batches of your loop."""
        self.current_step = self.trainer.load_checkpoint(checkpoint)
        return self.current_step


def check_constructor_inputs(config, model, ref_model, tokenizer, dataset, lr_scheduler) -> None:
    """trl 0.11's checks of the constructor's arguments, with its messages."""
    from datasets import Dataset

    if not isinstance(config, PPOConfig):
        raise ValueError(f"config must be a PPOConfig, got {type(config)}")
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise ValueError(
            "tokenizer must be a PreTrainedTokenizerBase like a PreTrainedTokenizer or a PreTrainedTokenizerFast, "
            f"got {type(tokenizer)}"
        )
    if not is_value_head_model(model):
        raise ValueError(f"model must be an AutoModelForCausalLMWithValueHead, got {type(model)}")
    if ref_model is not None and not isinstance(ref_model, torch.nn.Module):
        raise ValueError(f"ref_model must be an AutoModelForCausalLMWithValueHead or `None`, got {type(ref_model)}")
    if dataset is not None and not isinstance(dataset, (torch.utils.data.Dataset, Dataset)):
        raise ValueError("dataset must be a torch.utils.data.Dataset or datasets.Dataset")
    if lr_scheduler is not None and not isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise ValueError("lr_scheduler must be a torch.optim.lr_scheduler.LRScheduler")


def reference_model(model, ref_model, num_shared_layers: int | None):
    """The reference as trl 0.11 chose it: the given one (then `num_shared_layers` is ignored, with a warning),
    None under PEFT (the policy with its adapter disabled), else a frozen copy sharing `num_shared_layers`."""
    if ref_model is not None:
        if num_shared_layers is not None:
            warnings.warn(
                "num_shared_layers is ignored when ref_model is provided: the model and the reference model are "
                "two different models and no layers are shared.",
                UserWarning,
                stacklevel=3,
            )
        return ref_model
    if model.is_peft_model:
        return None
    return create_reference_model(model, num_shared_layers=num_shared_layers)


def check_step_inputs(batch_size: int, queries, responses, scores, response_masks) -> torch.Tensor:
    """trl 0.11's checks of `step()`'s inputs, with its messages -> the scores as a float32 `[B]` tensor."""
    for name, tensors in (("queries", queries), ("responses", responses), ("scores", scores)):
        if not isinstance(tensors, list):
            raise ValueError(f"{name} must be a list of tensors - got {type(tensors)}")
        if not tensors or not isinstance(tensors[0], torch.Tensor):
            raise ValueError(f"Elements in {name} must be tensors - got {type(tensors[0]) if tensors else 'none'}")
        if len(tensors) != batch_size:
            raise ValueError(
                f"Batch size ({batch_size}) does not match number of examples - but got {len(tensors)} for: {name}"
            )
    for score in scores:
        if score.dim() > 1:
            raise ValueError(f"Scores must be 1-dimensional - got {score.dim()} for {score}")
    if response_masks is not None and not isinstance(response_masks, list):
        raise ValueError(f"response_masks must be a list of tensors - got {type(response_masks)}")
    return episodes.scores_tensor(scores)

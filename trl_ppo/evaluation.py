"""Evaluation: sample a response to every prompt of an evaluation set and measure how the policy does there
(`evaluation_metrics`), and `PPOTrainer`'s `evaluate()` and `generate_completions()` (a mixin).

TRL's last PPO trainer had none (its `evaluate()` crashed and `eval_strategy` was ignored); here
`PPOTrainer.evaluate()` works alone and `eval_strategy` / `eval_steps` run it during `train()`.
"""

from __future__ import annotations

import math

import torch

from . import data, ppo
from .completions import sample_completions, show_table
from .metrics import reward_metrics
from .models import PreparedModels, context_length
from .reward_functions import check_reward_columns
from .rewards import Scoring
from .rollout import Sampling, chunks, collect_rollout


def process_share(dataset_length: int, num_processes: int, process_index: int) -> tuple[list[int], list[bool]]:
    """This process's prompt indices, and which of them count: every process gets `ceil(n / processes)` prompts
    (the same number of sampling calls everywhere, which ZeRO-3 needs), the last ones wrapping around to the start;
    a wrapped-around prompt is sampled but not counted, so each prompt counts exactly once."""
    share = math.ceil(dataset_length / num_processes)
    positions = range(process_index * share, (process_index + 1) * share)
    return [p % dataset_length for p in positions], [p < dataset_length for p in positions]


@torch.no_grad()
def evaluation_metrics(
    dataset, collate, models: PreparedModels, sampling: Sampling, scoring: Scoring, args, where: str, collect=None
) -> dict[str, float]:
    """Sample one response to every prompt of `dataset` (prepared prompts), score it, and return over all
    processes (unprefixed): `objective/scores` (and `objective/scores/<reward>`), `objective/kl` (summed per
    sequence, the training penalty's estimator), `val/mean_response_length` and `val/stop_token_frac` (responses
    whose last turn has `sampling.stop_token_id`, else EOS: `scoring.penalty_token_id`, as `missing_eos_penalty`
    reads them). `where` labels reward errors. `collect(batch)` makes the rollout of a batch (default:
    `rollout.collect_rollout`; the trainer's, with tools)."""
    # before sampling (`evaluate(eval_dataset=...)`)
    check_reward_columns(scoring.rewards, dataset, "eval_dataset", scoring.passed)
    accelerator = models.accelerator
    indices, counted = process_share(len(dataset), accelerator.num_processes, accelerator.process_index)
    totals, per_reward = torch.zeros(5, device=accelerator.device), {}
    stop_token_id = sampling.stop_token_id if sampling.stop_token_id is not None else scoring.penalty_token_id
    was_training = models.model.training
    models.model.eval()
    for part in chunks(len(indices), args.per_device_eval_batch_size):
        batch = collate([dataset[i] for i in indices[part]])
        valid = torch.tensor(counted[part], device=accelerator.device)
        rollout = collect_rollout(batch, models, sampling, args) if collect is None else collect(batch)
        scores, scores_per_reward = scoring(rollout, batch, where)
        mask = rollout.response_mask
        kl = rollout.per_token_kl(args.kl_penalty, args.kl_estimator)
        stopped = ppo.contains_stop_token(rollout.responses, ppo.last_turn_mask(mask), stop_token_id).float()
        weights = valid.float()
        totals += torch.stack(
            [(values.float() * weights).sum() for values in (scores, kl.sum(1), mask.sum(1).float(), stopped)]
            + [weights.sum()]
        )
        for name, (values, present) in scores_per_reward.items():
            per_reward.setdefault(name, []).append((values, valid if present is None else present & valid))
    models.model.train(was_training)

    score_sum, kl_sum, length_sum, stopped_sum, count = accelerator.reduce(totals, reduction="sum").tolist()
    metrics = {
        "objective/scores": score_sum / count,
        "objective/kl": kl_sum / count,
        "val/mean_response_length": length_sum / count,
        "val/stop_token_frac": stopped_sum / count,
    }
    merged = {
        name: (torch.cat([v for v, _ in parts]), torch.cat([p for _, p in parts])) for name, parts in per_reward.items()
    }
    metrics.update(reward_metrics(merged, accelerator))
    return {key: value for key, value in metrics.items() if "missing_scores" not in key}


class EvaluationMethods:
    """Mixed into `PPOTrainer`: uses its models, config, datasets and `_models()` / `_sampling()` / `_scoring()` /
    `collect_rollout()`."""

    @torch.no_grad()
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Sample one response (at the training temperature) to every prompt of `eval_dataset` (default: the
        trainer's), score it, and return and log over all processes `eval_objective/scores` (and per reward),
        `eval_objective/kl`, `eval_val/mean_response_length` and `eval_val/stop_token_frac`
        (`evaluation.evaluation_metrics`). `eval` is `metric_key_prefix`; trackers show `eval_x` as `eval/x`."""
        dataset = self.eval_dataset
        if eval_dataset is not None:
            context, vocab = context_length(self._models().wrapper.lm), self.vocabulary_size
            tokenizer = self.processing_class
            dataset = data.prepare_prompts(eval_dataset, tokenizer, self.args, context, "eval_dataset", vocab)
        if dataset is None:
            raise ValueError("`evaluate()` needs prompts: pass `eval_dataset` to it or to the trainer.")
        step = self.state.global_step
        where = f"Evaluation after update {step}" if step else "Evaluation before training"
        pieces = (self.data_collator, self._models(), self._sampling(), self._scoring(), self.args, where)
        metrics = evaluation_metrics(dataset, *pieces, collect=self.collect_rollout)
        metrics = {f"{metric_key_prefix}_{key}": value for key, value in metrics.items()}
        self.log({**metrics, "episode": getattr(self.state, "episode", 0)})  # the episode places it on the curves
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    @torch.no_grad()
    def generate_completions(self, sampling: bool = False) -> list[dict]:
        """Sample completions for evaluation prompts and show them with their scores (rows of `query`,
        `model response`, `score`, returned). With `sampling=True` (during training) only the first
        `per_device_eval_batch_size` prompts; otherwise the whole `eval_dataset` (or, without one, the first
        prompts of `train_dataset`)."""
        args, step = self.args, self.state.global_step
        dataset = self.eval_dataset if self.eval_dataset is not None else self.train_dataset
        whole = not sampling and self.eval_dataset is not None
        count = min(len(dataset), len(dataset) if whole else args.per_device_eval_batch_size)
        pieces = (self.data_collator, self._models(), self._sampling(), self._scoring())
        where, play = f"Completions table at update {step}", None if self.agents is None else self.collect_rollout
        rows = sample_completions(dataset, count, args.per_device_eval_batch_size, *pieces, where=where, play=play)
        if self.accelerator.is_main_process:
            show_table(rows, f"Completions at update {step} (sampled at temperature {args.temperature:g})",
                       args.report_to, step)
        return rows

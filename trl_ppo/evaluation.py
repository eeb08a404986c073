"""Evaluation: sample a response to every prompt of `eval_dataset` and report how the policy does there.

TRL's last PPO trainer had none (its `evaluate()` crashed and `eval_strategy` was ignored); here `evaluate()`
works alone and `eval_strategy` / `eval_steps` run it during `train()`.
"""

from __future__ import annotations

import math

import torch

from .metrics import reward_metrics
from .rollout import chunks


def process_share(dataset_length: int, num_processes: int, process_index: int) -> tuple[list[int], list[bool]]:
    """This process's prompt indices, and which of them count: every process gets `ceil(n / processes)` prompts
    (the same number of sampling calls everywhere, which ZeRO-3 needs), the last ones wrapping around to the start;
    a wrapped-around prompt is sampled but not counted, so each prompt counts exactly once."""
    share = math.ceil(dataset_length / num_processes)
    positions = range(process_index * share, (process_index + 1) * share)
    return [p % dataset_length for p in positions], [p < dataset_length for p in positions]


class EvaluationMixin:
    """`evaluate` for `PPOTrainer`."""

    @torch.no_grad()
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Sample one response (at the training temperature) to every prompt of `eval_dataset` (default: the
        trainer's), score it, and return and log, over all processes:

        - `eval_objective/scores`: mean score (the rewards' weighted sum, EOS penalty included), and
          `eval_objective/scores/<reward>` for each reward;
        - `eval_objective/kl`: mean summed per-token KL to the reference (the training penalty's estimator);
        - `eval_val/mean_response_length`: mean number of response tokens (up to and including the stop token);
        - `eval_val/stop_token_frac`: fraction of responses that end with the stop token (EOS when none is set).

        `eval` is `metric_key_prefix`; as for any `Trainer`, trackers show `eval_x` as `eval/x` (so
        `eval/objective/scores`). Sampling uses the global RNG, as in training.
        """
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if dataset is None:
            raise ValueError("`evaluate()` needs prompts: pass `eval_dataset` to it or to the trainer.")
        if eval_dataset is not None:
            from .data import fit_prompts, prepare_prompt_dataset
            from .models import context_length

            dataset = prepare_prompt_dataset(dataset, self.processing_class, self.args.dataset_num_proc)
            model_context = context_length(self.accelerator.unwrap_model(self.model).lm)
            dataset = fit_prompts(
                dataset, self.args.max_prompt_length, self.args.response_length, model_context, "eval_dataset"
            )
        args, accelerator = self.args, self.accelerator
        indices, counted = process_share(len(dataset), accelerator.num_processes, accelerator.process_index)
        totals, per_reward = torch.zeros(5, device=accelerator.device), {}
        stop_token_id = self.stop_token_id if self.stop_token_id is not None else self.penalty_token_id
        was_training = self.model.training
        self.model.eval()
        for part in chunks(len(indices), args.per_device_eval_batch_size):
            batch = self.data_collator([dataset[i] for i in indices[part]])
            valid = torch.tensor(counted[part], device=accelerator.device)
            rollout = self.collect_rollout(batch)
            scores, scores_per_reward = self.score(rollout, batch)
            kl = self.per_token_kl(rollout).sum(1)
            lengths = rollout.response_mask.sum(1).float()
            stopped = ((rollout.responses == stop_token_id) & rollout.response_mask).any(1).float()
            weights = valid.float()
            totals += torch.stack(
                [(values.float() * weights).sum() for values in (scores, kl, lengths, stopped)] + [weights.sum()]
            )
            for name, (values, present) in scores_per_reward.items():
                per_reward.setdefault(name, []).append((values, valid if present is None else present & valid))
        self.model.train(was_training)

        score_sum, kl_sum, length_sum, stopped_sum, count = accelerator.reduce(totals, reduction="sum").tolist()
        metrics = {
            "objective/scores": score_sum / count,
            "objective/kl": kl_sum / count,
            "val/mean_response_length": length_sum / count,
            "val/stop_token_frac": stopped_sum / count,
        }
        merged = {
            name: (torch.cat([v for v, _ in parts]), torch.cat([p for _, p in parts]))
            for name, parts in per_reward.items()
        }
        metrics.update(reward_metrics(merged, accelerator))
        metrics = {f"{metric_key_prefix}_{key}": value for key, value in metrics.items() if "missing_scores" not in key}
        self.log({**metrics, "episode": getattr(self.state, "episode", 0)})  # the episode places it on the curves
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

"""The step API: PPO updates on episodes generated and scored outside the trainer.

For a human in the loop, an environment or another process that produces (query, response, score) triplets:

    responses = trainer.generate(queries, return_prompt=False)   # or sample them elsewhere
    scores = [my_score(q, r) for q, r in zip(queries, responses)]
    stats = trainer.step(queries, responses, scores)

`step()` runs the same pieces as one update of `train()`: logprobs, reference KL and values of the given
episodes, per-token rewards, GAE, clipped multi-epoch minibatch updates, metrics, logging and checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from . import distributed as dist
from . import ppo
from .completions import show_table
from .data import LeftPaddingCollator
from .rollout import Rollout, chunks


class StepAPIMixin:
    """`generate` and `step` for `PPOTrainer`."""

    @torch.no_grad()
    def generate(
        self,
        query_tensor: torch.Tensor | Sequence[torch.Tensor],
        return_prompt: bool = True,
        batch_size: int | None = None,
        length_sampler: Callable[[], int] | None = None,
        **generation_kwargs,
    ) -> torch.Tensor | list[torch.Tensor]:
        """Sample a response for one query (a 1-D tensor of token ids) or for each of a list of them.

        Returns, for each query, the response ids (after the prompt when `return_prompt`, as in TRL's first
        `PPOTrainer`), ending at the stop token when one was sampled, without padding. Queries are sampled in
        batches of `batch_size` (default `local_rollout_forward_batch_size`). `generation_kwargs` may set
        `max_new_tokens` (default `response_length`), `temperature` and `eos_token_id`; options plain sampling
        does not have (top_k > 0, top_p < 1, ...) sample with `transformers`' `generate`. `length_sampler`, a
        callable returning an int, draws `max_new_tokens` anew for each batch (varied response lengths).
        """
        single = isinstance(query_tensor, torch.Tensor) and query_tensor.dim() == 1
        queries = _check_token_lists([query_tensor] if single else list(query_tensor), "query_tensor")
        batch_size = batch_size or self.args.local_rollout_forward_batch_size
        collate = LeftPaddingCollator(self.processing_class.pad_token_id)
        if dist.deepspeed_zero_stage(self.accelerator) == 3:  # each sampling call is a collective there
            dist.assert_consistent_across_processes(
                -(-len(queries) // batch_size),
                self.accelerator.device,
                "Under DeepSpeed ZeRO-3 every process must call `generate()` with as many batches of queries (the same "
                "number of queries and `batch_size`): sampling gathers weights from all processes.",
            )
        results = []
        for part in chunks(len(queries), batch_size):
            batch = collate([{"input_ids": query} for query in queries[part]])
            ids, mask = self._prompts_of(batch)
            if length_sampler is not None:
                generation_kwargs["max_new_tokens"] = int(length_sampler())
            responses = self._sample(ids, mask, **generation_kwargs)
            stop_token_id = generation_kwargs.get("eos_token_id", self.stop_token_id)
            keep = ppo.response_mask_after_stop(responses, stop_token_id)
            for query, response, kept in zip(queries[part], responses, keep):
                response = response[kept]
                results.append(torch.cat([query.to(response.device), response]) if return_prompt else response)
        return results[0] if single else results

    def step(
        self,
        queries: Sequence[torch.Tensor],
        responses: Sequence[torch.Tensor],
        scores: Sequence[float] | torch.Tensor,
    ) -> dict[str, float]:
        """One full PPO update on given episodes. Returns the update's metrics (the names `train()` logs).

        queries: this process's `local_batch_size` prompts, 1-D tensors of token ids (any lengths).
        responses: the response of each, 1-D token ids, exactly the tokens the policy produced (a stop token, if
            any, included; no padding).
        scores: one scalar score per episode (a float, a 0-d or 1-element tensor, or a `[B]` tensor).
        """
        args = self.args
        queries = _check_token_lists(list(queries), "queries")
        responses = _check_token_lists(list(responses), "responses")
        scores = _scores_tensor(scores)
        if not len(queries) == len(responses) == scores.numel():
            raise ValueError(
                f"`step()` got {len(queries)} queries, {len(responses)} responses and {scores.numel()} scores: "
                "give one response and one score per query."
            )
        if len(queries) != args.local_batch_size:
            raise ValueError(
                f"`step()` got {len(queries)} episodes, but one update takes `local_batch_size` = "
                f"per_device_train_batch_size * gradient_accumulation_steps = {args.local_batch_size} per process."
            )
        if not getattr(self, "_training_active", False):  # the first step (or the first after `train()` ended)
            self._begin_training(None)
        rollout = self._rollout_of(queries, responses)
        rollout.scores = scores.to(rollout.queries.device)

        self.add_logprobs_and_values(rollout)
        advantages, returns, reward_stats = self.compute_advantages(rollout)
        update_stats = self.ppo_update(rollout, advantages, returns)
        return self._end_update(rollout, reward_stats, update_stats, scores_per_reward={})

    def log_stats(self, stats: dict, batch: dict, rewards, columns_to_log: Sequence[str] = ("query", "response")):
        """Log `step()`'s `stats` to the configured trackers (`report_to`), and show a table of the batch's
        `columns_to_log` (texts, or token-id tensors that are decoded) with each episode's reward."""
        self.log({key: float(value) for key, value in stats.items()})
        columns = {}
        for name in columns_to_log:
            if name not in batch:
                raise ValueError(f"`log_stats`: the batch has no {name!r} column (columns: {list(batch)}).")
            values = batch[name]
            if len(values) and isinstance(values[0], torch.Tensor):
                values = self.processing_class.batch_decode(values, skip_special_tokens=True)
            columns[name] = list(values)
        rows = [dict(zip(columns, texts)) for texts in zip(*columns.values())]
        for row, reward in zip(rows, _scores_tensor(rewards).tolist()):
            row["reward"] = reward
        if self.accelerator.is_main_process:
            step = self.state.global_step
            show_table(rows, f"Episodes of update {step}", self.args.report_to, step, key="episodes")

    def _rollout_of(self, queries: list[torch.Tensor], responses: list[torch.Tensor]) -> Rollout:
        """Left-padded queries and right-padded responses as a `Rollout` on the device."""
        pad = self.processing_class.pad_token_id
        device = self.accelerator.device
        batch = LeftPaddingCollator(pad)([{"input_ids": query} for query in queries])
        query_ids, query_mask = batch["input_ids"].to(device), batch["attention_mask"].to(device).bool()
        response_ids = pad_sequence([r.to(device) for r in responses], batch_first=True, padding_value=pad)
        lengths = torch.tensor([r.numel() for r in responses], device=device)
        response_mask = torch.arange(response_ids.size(1), device=device).unsqueeze(0) < lengths.unsqueeze(1)
        return Rollout(query_ids, query_mask, response_ids, response_mask)


def _check_token_lists(tensors: list, name: str) -> list[torch.Tensor]:
    """Each item as a 1-D long tensor; an empty one or another shape is an error naming its position."""
    checked = []
    for index, tensor in enumerate(tensors):
        tensor = torch.as_tensor(tensor)
        if tensor.dim() != 1 or tensor.numel() == 0 or tensor.is_floating_point():
            raise ValueError(
                f"`{name}[{index}]` must be a non-empty 1-D tensor of token ids, got shape {tuple(tensor.shape)} "
                f"and dtype {tensor.dtype}."
            )
        checked.append(tensor.long())
    if not checked:
        raise ValueError(f"`{name}` is empty.")
    return checked


def _scores_tensor(scores) -> torch.Tensor:
    """Scores as a float32 `[B]` tensor; a score that is not one finite number is an error."""
    if isinstance(scores, torch.Tensor):
        values = scores.detach().float().reshape(-1)
    else:
        scores = [torch.as_tensor(score) for score in scores]
        if any(score.numel() != 1 for score in scores):
            raise ValueError("Each score given to `step()` must be a single number.")
        values = torch.stack([score.reshape(()).float() for score in scores]) if scores else torch.zeros(0)
    if not bool(torch.isfinite(values).all()):
        bad = values[~torch.isfinite(values)][0].item()
        raise ValueError(f"`step()` got a non-finite score ({bad}): scores must be finite numbers.")
    return values.cpu()

"""Rollout: sample responses from the policy and compute what the update needs about them (`RolloutMixin`, the
trainer's part). The sampling itself (the generation backends) is in `generation.py`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import distributed as dist
from . import ppo
from .generation import generation_backend
from .logprobs import ResponseOutput, response_logprobs
from .models import peft_reference


@dataclass
class Rollout:
    """One batch of episodes, from sampling to the update. `B` episodes, `Lq` prompt and `T` response tokens."""

    queries: torch.Tensor  # [B, Lq] left-padded prompt ids
    query_mask: torch.Tensor  # [B, Lq] True on prompt tokens
    responses: torch.Tensor  # [B, T] sampled ids, padding after the stop token
    response_mask: torch.Tensor  # [B, T] True up to and including the stop token
    logprobs: torch.Tensor | None = None  # [B, T] log pi_old of each response token (INVALID_LOGPROB on padding)
    ref_logprobs: torch.Tensor | None = None  # [B, T] log pi_ref
    values: torch.Tensor | None = None  # [B, T] V(s_t) before each response token (0 on padding)
    scores: torch.Tensor | None = None  # [B] sequence-level score, EOS penalty included
    full_kl: torch.Tensor | None = None  # [B, T] exact per-token KL(pi_old || pi_ref), with kl_penalty="full"

    @property
    def response_length(self) -> int:
        """`T`, the width of `responses` (the longest response, or `response_length` when sampled here)."""
        return self.responses.size(1)

    @property
    def input_ids(self) -> torch.Tensor:
        """Prompt and response concatenated. `[B, Lq + T]`."""
        return torch.cat([self.queries, self.responses], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """Attention over the prompt tokens and the response tokens up to the stop token. `[B, Lq + T]`."""
        return torch.cat([self.query_mask, self.response_mask], dim=1).long()

    def trim_padding(self) -> "Rollout":
        """The same episodes without the columns that are padding in all of them: prompt columns on the left,
        response columns after the longest response. Forward passes over it do less work for the same numbers
        (padded keys are masked out of attention, and causal attention never reads the columns on the right).
        Per-token fields become `[B, T']`; `pad_responses` widens results back to `T`."""
        first_prompt_column, width = torch.stack(
            [ppo.first_true_indices(self.query_mask.any(0)[None])[0], self.response_mask.sum(1).amax()]
        ).tolist()  # one device-to-host sync
        fields = dict(vars(self), queries=self.queries[:, first_prompt_column:])
        fields["query_mask"] = self.query_mask[:, first_prompt_column:]
        for name in ("responses", "response_mask", "logprobs", "ref_logprobs", "values", "full_kl"):
            if fields[name] is not None:
                fields[name] = fields[name][:, : max(width, 1)]
        return Rollout(**fields)

    def select(self, index: torch.Tensor) -> "Rollout":
        """The episodes at `index` (a 1-D index tensor)."""
        return Rollout(**{name: None if value is None else value[index] for name, value in vars(self).items()})


def pad_responses(values: torch.Tensor, length: int, fill: float) -> torch.Tensor:
    """Per-token results of trimmed episodes `[B, T']` widened to `[B, length]` with `fill`."""
    return torch.nn.functional.pad(values, (0, length - values.size(1)), value=fill)


def chunks(batch_size: int, chunk_size: int):
    """Slices covering `range(batch_size)` in pieces of at most `chunk_size`."""
    for start in range(0, batch_size, chunk_size):
        yield slice(start, min(start + chunk_size, batch_size))


def masked_response_logprobs(logprobs: torch.Tensor, rollout: Rollout) -> torch.Tensor:
    """Log-probs of the sampled response tokens `[B, T]` with INVALID_LOGPROB on padding."""
    return logprobs.masked_fill(~rollout.response_mask, ppo.INVALID_LOGPROB)


class RolloutMixin:
    """The rollout of `PPOTrainer`: sample responses to a batch of prompts, then the log-probabilities under the
    policy and the reference and the values. It relies on the trainer's `args`, `model`, `ref_model`, `accelerator`,
    `processing_class` and `stop_token_id`."""

    def collect_rollout(self, batch: dict) -> Rollout:
        """Sample one response per prompt, then compute logprobs, ref_logprobs and values (no gradients)."""
        queries, query_mask = self._prompts_of(batch)
        responses = self._sample(queries, query_mask)
        rollout = Rollout(queries, query_mask, responses, ppo.response_mask_after_stop(responses, self.stop_token_id))
        return self.add_logprobs_and_values(rollout)

    @torch.no_grad()
    def add_logprobs_and_values(self, rollout: Rollout) -> Rollout:
        """Fill `logprobs`, `ref_logprobs` and `values` `[B, T]` of a rollout, in chunks of
        `local_rollout_forward_batch_size` episodes."""
        args = self.args
        wrapper = self.accelerator.unwrap_model(self.model)
        full_kl = args.kl_penalty == "full"  # needs both full distributions, one chunk of episodes at a time
        logprobs, ref_logprobs, values, full_kls = [], [], [], []
        widen = functools.partial(pad_responses, length=rollout.response_length)  # trimmed chunks back to T
        with self.accelerator.autocast():
            for part in chunks(rollout.queries.size(0), args.local_rollout_forward_batch_size):
                episodes = rollout.select(part).trim_padding()
                output = wrapper(
                    episodes.input_ids,
                    episodes.attention_mask,
                    episodes.responses,
                    args.temperature,
                    args.logprobs_chunk_size,
                    keep_logits=full_kl,
                )
                ref_output = self._reference_output(episodes, keep_logits=full_kl)
                for results, logprob in ((logprobs, output.logprobs), (ref_logprobs, ref_output.logprobs)):
                    results.append(widen(masked_response_logprobs(logprob, episodes), fill=ppo.INVALID_LOGPROB))
                values.append(widen(output.values.masked_fill(~episodes.response_mask, 0.0), fill=0.0))
                if full_kl:
                    kl = ppo.full_kl_from_logits(output.logits, ref_output.logits)
                    full_kls.append(widen(kl.masked_fill(~episodes.response_mask, 0.0), fill=0.0))
                del output, ref_output  # one chunk of full logits alive at a time
        rollout.logprobs, rollout.ref_logprobs = torch.cat(logprobs), torch.cat(ref_logprobs)
        rollout.values = torch.cat(values)
        rollout.full_kl = torch.cat(full_kls) if full_kl else None
        return rollout

    def _prompts_of(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt ids, prompt mask) of a collated batch on the device, checked to be left-padded."""
        queries = batch["input_ids"].to(self.accelerator.device)
        if "attention_mask" in batch:
            query_mask = batch["attention_mask"].to(queries.device).bool()
        else:
            query_mask = queries != self.processing_class.pad_token_id
        if not bool(query_mask[:, -1].all()):
            raise ValueError(
                "Prompts must be left-padded (the response is appended after the last column), but this batch has "
                "padding at the end: use the default collator, or a tokenizer with `padding_side='left'`."
            )
        return queries, query_mask

    def _sample(self, queries: torch.Tensor, query_mask: torch.Tensor, **generation_kwargs) -> torch.Tensor:
        """Responses `[B, T]` to left-padded prompts, padded after the stop token. `generation_kwargs` can change
        `max_new_tokens` and `temperature` (and the `eos_token_id` that stops a response); others (top_k, ...)
        select `transformers`' `generate` as the backend (see `generation.generation_backend`)."""
        args = self.args
        sample, settings = generation_backend(
            self.sampling_backend, generation_kwargs, args.response_length, args.temperature, self.stop_token_id
        )
        wrapper = self.accelerator.unwrap_model(self.model)
        gather = args.ds3_gather_for_generation
        settings["synced_processes"] = dist.sampling_needs_sync(self.accelerator, gather)
        with dist.gathered_for_generation(self.model, wrapper, self.accelerator, gather):
            was_training = wrapper.training
            wrapper.eval()  # gradient checkpointing would turn the KV cache off in training mode
            try:
                with self.accelerator.autocast():
                    responses = [
                        sample(
                            wrapper.lm,
                            queries[part],
                            query_mask[part],
                            pad_token_id=self.processing_class.pad_token_id,
                            **settings,
                        )
                        for part in chunks(queries.size(0), args.local_rollout_forward_batch_size)
                    ]
            finally:
                wrapper.train(was_training)
        return torch.cat(responses)

    def _reference_output(self, episodes: Rollout, keep_logits: bool = False) -> ResponseOutput:
        """`ref_logprobs` `[B, T]` of the episodes' responses (and the reference's logits, with `keep_logits`)."""
        args = self.args
        inputs = (episodes.input_ids, episodes.attention_mask, episodes.responses, args.temperature)
        if self.ref_model is not None:
            return response_logprobs(self.ref_model, *inputs, args.logprobs_chunk_size, keep_logits=keep_logits)
        lm = self.accelerator.unwrap_model(self.model).lm
        with peft_reference(lm, args.ref_adapter_name, args.model_adapter_name):
            return response_logprobs(lm, *inputs, args.logprobs_chunk_size, keep_logits=keep_logits)

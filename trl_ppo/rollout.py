"""The `Rollout` record, and how one is made: sample responses to prompts, then compute what the update needs
about them (`logprobs`, `ref_logprobs`, `values`) without gradients.

The sampling backends themselves (plain KV-cache loop, `generate`, compiled) are in `generation.py`; the
log-probabilities from hidden states in `logprobs.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from . import distributed as dist
from . import kl, ppo
from .data import prompts_on_device
from .fsdp import root_call
from .generation import generation_backend
from .logprobs import ResponseOutput, response_logprobs
from .models import PreparedModels, peft_reference

# Per-token fields of a `Rollout`, each `[B, T]`: cut together by `trim_padding`.
PER_TOKEN_FIELDS = (
    "responses",
    "response_mask",
    "response_attention_mask",
    "logprobs",
    "ref_logprobs",
    "values",
    "full_kl",
    "advantages",
    "returns",
)


@dataclass
class Rollout:
    """One batch of episodes, from sampling to the update. `B` episodes, `Lq` prompt and `T` response tokens."""

    queries: torch.Tensor  # [B, Lq] left-padded prompt ids
    query_mask: torch.Tensor  # [B, Lq] True on prompt tokens
    responses: torch.Tensor  # [B, T] sampled ids, padding after the stop token
    response_mask: torch.Tensor  # [B, T] True on the tokens trained on: up to and including the stop token
    logprobs: torch.Tensor | None = None  # [B, T] log pi_old of each response token (INVALID_LOGPROB on padding)
    ref_logprobs: torch.Tensor | None = None  # [B, T] log pi_ref
    values: torch.Tensor | None = None  # [B, T] V(s_t) before each response token (0 on padding); None: no critic
    scores: torch.Tensor | None = None  # [B] sequence-level score, EOS penalty included
    full_kl: torch.Tensor | None = None  # [B, T] exact per-token KL(pi_old || pi_ref), with kl_penalty="full"
    advantages: torch.Tensor | None = None  # [B, T] whitened GAE advantages (set for the update)
    returns: torch.Tensor | None = None  # [B, T] value targets (set for the update; None without a critic)
    # [B, T] True on every response token, where `step(response_masks=...)` leaves some out of `response_mask`
    # (e.g. tool output): those are attended to but not trained on. None: the same as `response_mask`.
    response_attention_mask: torch.Tensor | None = None
    turn_rewards: torch.Tensor | None = None  # [B, K] per-turn rewards of multi-turn episodes (`agents`), or None
    # [B] bool: cut before their end (by the budget, `max_turns`, no room for the model); None where not known
    truncated: torch.Tensor | None = None

    @property
    def response_length(self) -> int:
        """`T`, the width of `responses` (the longest response, or `response_length` when sampled here)."""
        return self.responses.size(1)

    @property
    def input_ids(self) -> torch.Tensor:
        """Prompt and response concatenated. `[B, Lq + T]`."""
        return torch.cat([self.queries, self.responses], dim=1)

    @property
    def attended_responses(self) -> torch.Tensor:
        """`[B, T]` True on every response token (padding excluded), trained on or not."""
        return self.response_mask if self.response_attention_mask is None else self.response_attention_mask

    @property
    def attention_mask(self) -> torch.Tensor:
        """Attention over the prompt tokens and the response tokens up to the stop token. `[B, Lq + T]`."""
        return torch.cat([self.query_mask, self.attended_responses], dim=1).long()

    def per_token_kl(self, penalty: str = "kl", estimator: str = "k1") -> torch.Tensor:
        """The KL term of the rewards `[B, T]` (`kl.per_token_kl` of the filled log-probs, or `full_kl` with
        `penalty="full"`), zero on padding."""
        mask = self.response_mask
        return kl.per_token_kl(self.logprobs, self.ref_logprobs, mask, penalty, estimator, self.full_kl)

    def with_advantages(self, advantages: ppo.Advantages) -> "Rollout":
        """The same episodes carrying `advantages` and `returns` (what the update reads per minibatch)."""
        return dataclasses.replace(self, advantages=advantages.advantages, returns=advantages.returns)

    def trim_padding(self) -> "Rollout":
        """The same episodes without the columns that are padding in all of them: prompt columns on the left,
        response columns after the longest response. Forward passes over it do less work for the same numbers
        (padded keys are masked out of attention, and causal attention never reads the columns on the right).
        Per-token fields become `[B, T']`; `ppo.pad_responses` widens results back to `T`."""
        first_prompt_column, width = torch.stack(
            [ppo.first_true_indices(self.query_mask.any(0)[None])[0], self.attended_responses.sum(1).amax()]
        ).tolist()  # one device-to-host sync
        fields = dict(vars(self), queries=self.queries[:, first_prompt_column:])
        fields["query_mask"] = self.query_mask[:, first_prompt_column:]
        for name in PER_TOKEN_FIELDS:
            if fields[name] is not None:
                fields[name] = fields[name][:, : max(width, 1)]
        return Rollout(**fields)

    def select(self, index: torch.Tensor | slice) -> "Rollout":
        """The episodes at `index` (a 1-D index tensor or a slice)."""
        return Rollout(**{name: None if value is None else value[index] for name, value in vars(self).items()})


def chunks(batch_size: int, chunk_size: int):
    """Slices covering `range(batch_size)` in pieces of at most `chunk_size`."""
    for start in range(0, batch_size, chunk_size):
        yield slice(start, min(start + chunk_size, batch_size))


def masked_response_logprobs(logprobs: torch.Tensor, rollout: Rollout) -> torch.Tensor:
    """Log-probs of the sampled response tokens `[B, T]` with INVALID_LOGPROB on padding."""
    return logprobs.masked_fill(~rollout.response_mask, ppo.INVALID_LOGPROB)


# ------------------------------------------------------------------------------------------------ sampling
@dataclass(frozen=True)
class Sampling:
    """How a run samples its responses (from the config, the tokenizer and the resolved backend)."""

    backend: str  # a resolved `generation_backend` name
    response_length: int
    temperature: float
    stop_token_id: int | None
    pad_token_id: int
    chunk_size: int  # `local_rollout_forward_batch_size`: prompts per sampling call
    gather_weights: bool = True  # `ds3_gather_for_generation`

    @classmethod
    def from_config(cls, args, backend: str, stop_token_id: int | None, pad_token_id: int) -> "Sampling":
        chunk, gather = args.local_rollout_forward_batch_size, args.ds3_gather_for_generation
        return cls(backend, args.response_length, args.temperature, stop_token_id, pad_token_id, chunk, gather)


def collect_rollout(batch: dict, models: PreparedModels, sampling: Sampling, args) -> Rollout:
    """The rollout of a collated batch of prompts: one sampled response each, then `logprobs`, `ref_logprobs`
    and `values` (no gradients)."""
    queries, query_mask = prompts_on_device(batch, models.accelerator.device, sampling.pad_token_id)
    return add_logprobs_and_values(sample_rollout(models, queries, query_mask, sampling), models, args)


def sample_rollout(
    models: PreparedModels, queries: torch.Tensor, query_mask: torch.Tensor, sampling: Sampling, **generation_kwargs
) -> Rollout:
    """Sample one response to each left-padded prompt `[B, Lq]` -> a `Rollout` of the prompts, the responses
    `[B, T]` and their masks (True up to the stop token; `generation_kwargs["eos_token_id"]` overrides it)."""
    responses = sample_responses(models, queries, query_mask, sampling, **generation_kwargs)
    stop_token_id = generation_kwargs.get("eos_token_id", sampling.stop_token_id)
    return Rollout(queries, query_mask, responses, ppo.response_mask_after_stop(responses, stop_token_id))


def sample_responses(
    models: PreparedModels, queries: torch.Tensor, query_mask: torch.Tensor, sampling: Sampling, **generation_kwargs
) -> torch.Tensor:
    """Responses `[B, T]` to left-padded prompts, padded after the stop token, in calls of `sampling.chunk_size`
    prompts. `generation_kwargs` can change `max_new_tokens`, `temperature` and `eos_token_id`; others (top_k,
    ...) select `transformers`' `generate` as the backend (see `generation.generation_backend`)."""
    sample, settings = generation_backend(
        sampling.backend, generation_kwargs, sampling.response_length, sampling.temperature, sampling.stop_token_id
    )
    accelerator, wrapper = models.accelerator, models.wrapper
    settings["synced_processes"] = dist.sampling_needs_sync(accelerator, sampling.gather_weights)
    with dist.gathered_for_generation(models.model, wrapper, accelerator, sampling.gather_weights):
        was_training = wrapper.training
        wrapper.eval()  # gradient checkpointing would turn the KV cache off in training mode
        try:
            parts = list(chunks(queries.size(0), sampling.chunk_size))
            own = len(parts)
            if settings["synced_processes"]:  # every forward is a collective: as many calls as the busiest process
                calls = dist.max_over_processes(len(parts), accelerator.device)
                parts += [slice(0, 1)] * (calls - len(parts))  # extra calls on one row, their tokens dropped
            with accelerator.autocast():
                responses = [
                    root_call(wrapper, lambda module, part=part: sample(
                        module.lm, queries[part], query_mask[part], pad_token_id=sampling.pad_token_id, **settings
                    ))
                    for part in parts
                ][:own]
        finally:
            wrapper.train(was_training)
    return torch.cat(responses)


# ------------------------------------------------------------------------------------ logprobs and values
@torch.no_grad()
def add_logprobs_and_values(rollout: Rollout, models: PreparedModels, args) -> Rollout:
    """Fill `logprobs`, `ref_logprobs` and `values` `[B, T]` of a rollout (values None without a critic; and
    `full_kl` with `kl_penalty="full"`), in chunks of `args.local_rollout_forward_batch_size` episodes. Returns the
    rollout."""
    full_kl = args.kl_penalty == "full"  # needs both full distributions, one chunk of episodes at a time
    logprobs, ref_logprobs, values, full_kls = [], [], [], []
    widen = functools.partial(ppo.pad_responses, length=rollout.response_length)  # trimmed chunks back to T
    with models.accelerator.autocast():
        for part in chunks(rollout.queries.size(0), args.local_rollout_forward_batch_size):
            episodes = rollout.select(part).trim_padding()
            output = models.wrapper(
                episodes.input_ids,
                episodes.attention_mask,
                episodes.responses,
                args.temperature,
                args.logprobs_chunk_size,
                keep_logits=full_kl,
            )
            ref_output = reference_output(episodes, models, args, keep_logits=full_kl)
            for results, logprob in ((logprobs, output.logprobs), (ref_logprobs, ref_output.logprobs)):
                results.append(widen(masked_response_logprobs(logprob, episodes), fill=ppo.INVALID_LOGPROB))
            if output.values is not None:  # None without a critic (a critic-free `advantage_estimator`)
                values.append(widen(output.values.masked_fill(~episodes.response_mask, 0.0), fill=0.0))
            if full_kl:
                exact = kl.full_kl_from_logits(output.logits, ref_output.logits)
                full_kls.append(widen(exact.masked_fill(~episodes.response_mask, 0.0), fill=0.0))
            del output, ref_output  # one chunk of full logits alive at a time
    rollout.logprobs, rollout.ref_logprobs = torch.cat(logprobs), torch.cat(ref_logprobs)
    rollout.values = torch.cat(values) if values else None
    rollout.full_kl = torch.cat(full_kls) if full_kl else None
    return rollout


def reference_output(episodes: Rollout, models: PreparedModels, args, keep_logits: bool = False) -> ResponseOutput:
    """`ref_logprobs` `[B, T]` of the episodes' responses under the reference (and its logits, with
    `keep_logits`): `models.ref_model`, or the PEFT policy with its adapter disabled."""
    inputs = (episodes.input_ids, episodes.attention_mask, episodes.responses, args.temperature)
    options = {"chunk_size": args.logprobs_chunk_size, "keep_logits": keep_logits}
    if models.ref_model is not None:  # `root_call`: under FSDP2 its parts run as one forward of its root
        return root_call(models.ref_model, response_logprobs, *inputs, **options)
    wrapper = models.wrapper
    with peft_reference(wrapper.lm, args.ref_adapter_name, args.model_adapter_name):
        return root_call(wrapper, lambda module: response_logprobs(module.lm, *inputs, **options))

"""How a `Rollout` is made: sample responses to prompts (`generation.py` holds the sampling backends), then
compute what the update needs about them (`logprobs`, `ref_logprobs`, `values`) without gradients; the
log-probabilities from hidden states are in `logprobs.py`.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch

from .. import distributed as dist
from .. import kl, ppo
from ..data import prompts_on_device
from ..fsdp import root_call
from ..logprobs import ResponseOutput, response_logprobs
from ..models import PreparedModels, peft_reference
from .generation import draws_from_generator, generation_backend
from .record import Rollout, chunks, masked_response_logprobs
from .vllm_engine import VLLMEngine


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
    # what sampling draws from; None: the process-wide generator (the asynchronous sampler has one of its own)
    generator: torch.Generator | None = field(default=None, compare=False)
    # 'vllm': the engine that samples the training rollouts and the update its weights must be from
    engine: VLLMEngine | None = field(default=None, compare=False)
    version: int | None = None

    @classmethod
    def from_config(cls, args, backend: str, stop_token_id: int | None, pad_token_id: int) -> "Sampling":
        chunk, gather = args.local_rollout_forward_batch_size, args.ds3_gather_for_generation
        return cls(backend, args.response_length, args.temperature, stop_token_id, pad_token_id, chunk, gather)


def collect_rollout(
    batch: dict, models: PreparedModels, sampling: Sampling, args, behaviour_only: bool = False
) -> Rollout:
    """The rollout of a collated batch of prompts: one sampled response each, then `logprobs`, `ref_logprobs`
    and `values` (no gradients; `behaviour_only`: as `add_logprobs_and_values`)."""
    queries, query_mask = prompts_on_device(batch, models.accelerator.device, sampling.pad_token_id)
    rollout = sample_rollout(models, queries, query_mask, sampling)
    return add_logprobs_and_values(rollout, models, args, behaviour_only=behaviour_only)


def sample_rollout(
    models: PreparedModels, queries: torch.Tensor, query_mask: torch.Tensor, sampling: Sampling, **generation_kwargs
) -> Rollout:
    """Sample one response to each left-padded prompt `[B, Lq]` -> a `Rollout` of the prompts, the responses
    `[B, T]` and their masks (True up to the stop token; `generation_kwargs["eos_token_id"]` overrides it). With
    `sampling.engine` and no `generation_kwargs`, the engine samples and its log-probs are the `sampler_logprobs`."""
    if sampling.engine is not None and not generation_kwargs:
        responses, sampler_logprobs = sampling.engine.sample(
            queries, query_mask, sampling.response_length, sampling.temperature, sampling.stop_token_id,
            sampling.pad_token_id, generator=sampling.generator, version=sampling.version,
        )  # fmt: skip
        mask = ppo.response_mask_after_stop(responses, sampling.stop_token_id)
        sampler_logprobs = sampler_logprobs.masked_fill(~mask, ppo.INVALID_LOGPROB)
        return Rollout(queries, query_mask, responses, mask, sampler_logprobs=sampler_logprobs)
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
    if sampling.generator is not None:
        if not draws_from_generator(sample):  # the caller checks first (`takes_generator`): a bug otherwise
            raise ValueError(f"The {sampling.backend!r} sampling draws from the process-wide generator only.")
        settings["generator"] = sampling.generator
    with policy_sampling(models, sampling):
        parts = list(chunks(queries.size(0), sampling.chunk_size))
        own = len(parts)
        if settings["synced_processes"]:  # every forward is a collective: as many calls as the busiest process
            calls = dist.max_over_processes(len(parts), accelerator.device)
            parts += [slice(0, 1)] * (calls - len(parts))  # extra calls on one row, their tokens dropped
        responses = [
            root_call(wrapper, lambda module, part=part: sample(
                module.lm, queries[part], query_mask[part], pad_token_id=sampling.pad_token_id, **settings
            ))
            for part in parts
        ][:own]
    return torch.cat(responses)


@contextlib.contextmanager
def policy_sampling(models: PreparedModels, sampling: Sampling):
    """The policy ready to sample, for the duration of the block: its weights gathered where they are sharded
    (`ds3_gather_for_generation`), eval mode (gradient checkpointing would turn the KV cache off in training mode),
    the accelerator's autocast."""
    wrapper = models.wrapper
    with dist.gathered_for_generation(models.model, wrapper, models.accelerator, sampling.gather_weights):
        was_training = wrapper.training
        wrapper.eval()
        try:
            with models.accelerator.autocast():
                yield
        finally:
            wrapper.train(was_training)


# ------------------------------------------------------------------------------------ logprobs and values
@torch.no_grad()
def add_logprobs_and_values(
    rollout: Rollout, models: PreparedModels, args, reference: bool = True, behaviour_only: bool = False
) -> Rollout:
    """Fill `logprobs`, `ref_logprobs` and `values` `[B, T]` of a rollout (values None without a critic; and
    `full_kl` with `kl_penalty="full"`), in chunks of `args.local_rollout_forward_batch_size` episodes. Returns the
    rollout. `reference=False` keeps the rollout's `ref_logprobs` (asynchronous sampling computed them: the
    reference does not change). `behaviour_only`: the asynchronous sampler's rollout, which needs the behaviour
    policy's log-probs and the reference's only (the trainer recomputes the policy's and the values with its
    current weights): no values, and no policy forward where the sampler recorded its log-probs (the episode
    engine's) and no exact KL needs the policy's logits."""
    full_kl = args.kl_penalty == "full"  # needs both full distributions, one chunk of episodes at a time
    recorded = behaviour_only and rollout.sampler_logprobs is not None and not full_kl  # one process: no collective
    sampled = recorded or sampler_logprobs_suffice(rollout, models, args)  # then the policy's forward is skipped
    logprobs, ref_logprobs, value_parts, full_kls = [], [], [], []
    widen = functools.partial(ppo.pad_responses, length=rollout.response_length)  # trimmed chunks back to T
    with models.accelerator.autocast():
        for part in chunks(rollout.queries.size(0), args.local_rollout_forward_batch_size):
            episodes = rollout.select(part).trim_padding()
            output = None if sampled else models.wrapper(
                episodes.input_ids,
                episodes.attention_mask,
                episodes.responses,
                args.temperature,
                args.logprobs_chunk_size,
                keep_logits=full_kl,
                values=not behaviour_only,  # a separate value model's skipped; a value head's dropped below
            )  # fmt: skip
            ref_output = reference_output(episodes, models, args, keep_logits=full_kl) if reference else None
            if output is not None:
                logprobs.append(widen(masked_response_logprobs(output.logprobs, episodes), fill=ppo.INVALID_LOGPROB))
            if reference:
                ref = masked_response_logprobs(ref_output.logprobs, episodes)
                ref_logprobs.append(widen(ref, fill=ppo.INVALID_LOGPROB))
            if output is not None and output.values is not None and not behaviour_only:  # None without a critic
                value_parts.append(widen(output.values.masked_fill(~episodes.response_mask, 0.0), fill=0.0))
            if full_kl:
                exact = kl.full_kl_from_logits(output.logits, ref_output.logits)
                full_kls.append(widen(exact.masked_fill(~episodes.response_mask, 0.0), fill=0.0))
            del output, ref_output  # one chunk of full logits alive at a time
    rollout.logprobs = rollout.sampler_logprobs if sampled else torch.cat(logprobs)
    rollout.ref_logprobs = torch.cat(ref_logprobs) if reference else rollout.ref_logprobs
    rollout.values = torch.cat(value_parts) if value_parts else None
    rollout.full_kl = torch.cat(full_kls) if full_kl else None
    return rollout


def sampler_logprobs_suffice(rollout: Rollout, models: PreparedModels, args) -> bool:
    """Whether the sampler's log-probs stand for the policy's no-grad forward (`use_sampler_logprobs`, checked
    against a critic and the exact KL by `validate_config`): asked for, and recorded on every process (the
    forward is a collective under DDP and sharding, so every process skips it or none does)."""
    if not getattr(args, "use_sampler_logprobs", False):
        return False
    return dist.all_processes(rollout.sampler_logprobs is not None, models.accelerator.device)


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

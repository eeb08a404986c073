"""The step API's pieces: PPO updates on episodes generated and scored outside the trainer
(`PPOTrainer.generate`, `step` and `log_stats` call them).

For a human in the loop, an environment or another process that produces (query, response, score) triplets:

    responses = trainer.generate(queries, return_prompt=False)   # or sample them elsewhere
    scores = [my_score(q, r) for q, r in zip(queries, responses)]
    stats = trainer.step(queries, responses, scores)

`step()` runs the same pieces as one update of `train()`: logprobs, reference KL and values of the given
episodes, per-token rewards, GAE, clipped multi-epoch minibatch updates, metrics, logging and checkpoints.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from . import distributed as dist
from . import ppo, prompt_checks
from .data import LeftPaddingCollator, check_token_ids, prompts_on_device, require_pad_token
from .models import PolicyAndValueWrapper, PreparedModels, context_length, peft_reference
from .rewards import MAX_ABS_SCORE
from .rollout import Rollout, Sampling, chunks, sample_rollout
from .update import UpdateResult
from .value_head import AutoModelForCausalLMWithValueHead, is_value_head_model


@dataclass
class EpisodeUpdate:
    """Everything one `step()` made: the filled rollout, its rewards and advantages, the update's result, the
    metrics it logged, and the seconds each phase took (`PhaseClock`)."""

    rollout: Rollout
    rewards: ppo.Rewards
    advantages: ppo.Advantages
    result: UpdateResult
    metrics: dict[str, float]
    seconds: dict[str, float] = field(default_factory=dict)


class PhaseClock:
    """Wall-clock seconds of consecutive phases: `lap(name)` ends the phase begun at the previous lap."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = now - self._last
        self._last = now


def generate_responses(
    queries: list[torch.Tensor],
    models: PreparedModels,
    sampling: Sampling,
    batch_size: int,
    return_prompt: bool,
    length_sampler: Callable[[], int] | None,
    generation_kwargs: dict,
    vocab_size: int,
) -> list[torch.Tensor]:
    """`PPOTrainer.generate` for a list of 1-D queries: each response cut after its stop token, without padding
    (after its query when `return_prompt`), sampled `batch_size` queries at a time. The request is checked first
    (`check_generation_request`); a `length_sampler`'s draw before the batch it is for."""
    context = context_length(models.wrapper.lm)
    max_new_tokens = None if length_sampler else generation_kwargs.get("max_new_tokens", sampling.response_length)
    device = models.accelerator.device
    request = (queries, batch_size, max_new_tokens, vocab_size, context, sampling.pad_token_id, generation_kwargs)
    dist.checked_on_every_process(lambda: check_generation_request(*request), device, "`generate()` queries")
    collate = LeftPaddingCollator(sampling.pad_token_id)
    if dist.weights_are_sharded(models.accelerator):  # each sampling call is a collective there
        dist.assert_consistent_across_processes(
            -(-len(queries) // batch_size),
            device,
            "Under DeepSpeed ZeRO-3 or FSDP2 every process must call `generate()` with as many batches of queries (the "
            "same number of queries and `batch_size`): sampling gathers weights from all processes.",
        )
    results = []
    for part in chunks(len(queries), batch_size):
        ids, mask = prompts_on_device(
            collate([{"input_ids": query} for query in queries[part]]), device, collate.pad_token_id
        )
        if length_sampler is not None:
            generation_kwargs["max_new_tokens"] = int(length_sampler())
            longest = max(query.numel() for query in queries[part])
            check_max_new_tokens(generation_kwargs["max_new_tokens"], longest, context, "`length_sampler()`")
        rollout = sample_rollout(models, ids, mask, sampling, **generation_kwargs)
        for query, response, kept in zip(queries[part], rollout.responses, rollout.response_mask):
            response = response[kept]
            results.append(torch.cat([query.to(response.device), response]) if return_prompt else response)
    return results


@contextlib.contextmanager
def sampling_models(models: PreparedModels, reference: bool, args):
    """The models `generate_responses` samples with: the policy's, or with `reference` the reference policy's (the
    reference model as a policy; or the PEFT policy with its adapter disabled)."""
    if not reference:
        yield models
    elif models.ref_model is None:
        with peft_reference(models.wrapper.lm, args.ref_adapter_name, args.model_adapter_name):
            yield models
    else:
        if dist.weights_are_sharded(models.accelerator):
            raise ValueError("Sampling from the reference model is not supported under DeepSpeed ZeRO-3 or FSDP2.")
        reference_model = models.ref_model
        if not is_value_head_model(reference_model):  # a plain causal LM: an unused head makes it readable
            with torch.random.fork_rng(devices=[]):  # and leaves the RNG stream alone
                reference_model = AutoModelForCausalLMWithValueHead(reference_model)
        yield PreparedModels(models.accelerator, PolicyAndValueWrapper(reference_model, None), None)


def rollout_of(
    queries: list[torch.Tensor],
    responses: list[torch.Tensor],
    pad_token_id: int,
    device,
    response_masks: list[torch.Tensor] | None = None,
) -> Rollout:
    """Given episodes as a `Rollout` on `device`: queries left-padded, responses right-padded, masks from their
    lengths. `response_masks` (one 1-D 0/1 tensor per response, as long as it) leaves tokens out of training:
    they stay attended to (`Rollout.response_attention_mask`) but get no loss, no KL and no score."""
    batch = LeftPaddingCollator(pad_token_id)([{"input_ids": query} for query in queries])
    query_ids, query_mask = batch["input_ids"].to(device), batch["attention_mask"].to(device).bool()
    response_ids = pad_sequence([r.to(device) for r in responses], batch_first=True, padding_value=pad_token_id)
    lengths = torch.tensor([r.numel() for r in responses], device=device)
    response_mask = torch.arange(response_ids.size(1), device=device).unsqueeze(0) < lengths.unsqueeze(1)
    if response_masks is None:
        return Rollout(query_ids, query_mask, response_ids, response_mask)
    given = pad_sequence([m.to(device).bool() for m in response_masks], batch_first=True, padding_value=False)
    return Rollout(query_ids, query_mask, response_ids, given & response_mask, response_attention_mask=response_mask)


def check_response_masks(response_masks, responses: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """`step()`'s `response_masks` checked: None, or one 1-D tensor of 0/1 per response, as long as it."""
    if response_masks is None:
        return None
    response_masks = list(response_masks)
    if len(response_masks) != len(responses):
        raise ValueError(f"`response_masks` has {len(response_masks)} masks for {len(responses)} responses.")
    checked = []
    for index, (mask, response) in enumerate(zip(response_masks, responses)):
        mask = torch.as_tensor(mask)
        if mask.shape != response.shape or not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(
                f"`response_masks[{index}]` must be a 1-D tensor of 0s and 1s as long as `responses[{index}]` "
                f"({response.numel()} tokens), got shape {tuple(mask.shape)}."
            )
        checked.append(mask.bool())
    if not any(bool(mask.any()) for mask in checked):
        raise ValueError(
            "`response_masks` are all zeros: no response token is left to train on (the update would be empty, "
            "and its statistics undefined). Leave at least one token of one response unmasked, or skip this batch."
        )
    return checked


def check_episodes(
    queries, responses, scores, response_masks, local_batch_size: int, vocab_size: int, context: int | None, tokenizer
):
    """`step()`'s inputs checked -> (queries, responses: lists of 1-D long tensors with ids below `vocab_size`,
    queries without padding, each episode within the model's `context`; scores: float32 `[B]`; response masks,
    `check_response_masks`). `tokenizer`: the policy's, whose pad token is needed."""
    require_pad_token(tokenizer.pad_token_id, "`step()` (it pads queries and responses)")
    queries = check_token_lists(list(queries), "queries")
    responses = check_token_lists(list(responses), "responses")
    check_episode_token_ids(queries, responses, vocab_size)
    check_episode_lengths(queries, responses, context)
    padded = [index for index, query in enumerate(queries) if prompt_checks.looks_padded(query.tolist(), tokenizer)]
    if padded:
        fix = "Give each query's own tokens (e.g. `tokenizer(text, return_tensors='pt').input_ids[0]`)."
        raise prompt_checks.padding_error(tokenizer, "`step()`'s `queries`", padded, queries[padded[0]].tolist(), fix)
    scores = scores_tensor(scores)
    if not len(queries) == len(responses) == scores.numel():
        raise ValueError(
            f"`step()` got {len(queries)} queries, {len(responses)} responses and {scores.numel()} scores: "
            "give one response and one score per query."
        )
    if len(queries) != local_batch_size:
        raise ValueError(
            f"`step()` got {len(queries)} episodes, but one update takes `local_batch_size` = "
            f"per_device_train_batch_size * gradient_accumulation_steps = {local_batch_size} per process."
        )
    return queries, responses, scores, check_response_masks(response_masks, responses)


def episode_rows(batch: dict, rewards, columns_to_log, tokenizer) -> list[dict]:
    """`log_stats`' table: the batch's `columns_to_log` (texts, or token-id tensors that are decoded) and each
    episode's reward."""
    check_rewards_match_batch(rewards, batch, columns_to_log)
    columns = {}
    for name in columns_to_log:
        if name not in batch:
            raise ValueError(f"`log_stats`: the batch has no {name!r} column (columns: {list(batch)}).")
        values = batch[name]
        if len(values) and isinstance(values[0], torch.Tensor):
            values = tokenizer.batch_decode(values, skip_special_tokens=True)
        columns[name] = list(values)
    rows = [dict(zip(columns, texts)) for texts in zip(*columns.values())]
    for row, reward in zip(rows, scores_tensor(rewards, "`log_stats()`'s `rewards`").tolist()):
        row["reward"] = reward
    return rows


def check_rewards_match_batch(rewards, batch: dict, columns_to_log, batch_size: int | None = None) -> None:
    """`log_stats`' `rewards`: one per episode, i.e. per row of each of the batch's logged columns (without any of
    them, `batch_size`), so that a table row never shows another episode's reward."""
    count = scores_tensor(rewards, "`log_stats()`'s `rewards`").numel()
    lengths = {f"`batch[{name!r}]`": len(batch[name]) for name in columns_to_log if name in batch}
    if not lengths and batch_size is not None:
        lengths = {"`batch_size`": batch_size}
    wrong = [f"{name} has {length}" for name, length in lengths.items() if length != count]
    if wrong:
        raise ValueError(f"`log_stats` got {count} rewards, but {', '.join(wrong)}: give one reward per episode.")


def check_episode_token_ids(queries: list[torch.Tensor], responses: list[torch.Tensor], vocab_size: int) -> None:
    """Refuse a query or response token id that the policy cannot read (`data.check_token_ids`)."""
    check_token_ids(queries, vocab_size, "`step()`'s `queries`")
    check_token_ids(responses, vocab_size, "`step()`'s `responses`")


def check_episode_lengths(queries: list[torch.Tensor], responses: list[torch.Tensor], context: int | None) -> None:
    """Refuse an episode (query + response) longer than the model's `context` (its position embeddings): some
    architectures fail with an index error, others (rotary) would train on positions they were never built for."""
    if context is None:
        return
    for index, (query, response) in enumerate(zip(queries, responses)):
        if query.numel() + response.numel() > context:
            raise ValueError(
                f"`step()`: episode {index} has {query.numel()} query and {response.numel()} response tokens, "
                f"{query.numel() + response.numel()} in all, more than the model's context ({context} positions). "
                "Cut its query, or sample shorter responses."
            )


def check_generation_request(
    queries: list[torch.Tensor],
    batch_size,
    max_new_tokens,
    vocab_size: int,
    context: int | None,
    pad_token_id,
    generation_kwargs: dict | None = None,
) -> None:
    """`generate()`'s request checked before any sampling: a positive `batch_size`, query ids the policy can read,
    a positive `max_new_tokens` that fits the model's context after the longest query (None: a `length_sampler`
    draws it, and each draw is checked), a pad token, and the `generation_kwargs` overrides
    (`check_generation_kwargs`)."""
    check_generation_kwargs(generation_kwargs or {}, vocab_size)
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise ValueError(
            f"`generate()`'s `batch_size` (queries sampled at a time) must be a positive integer, got {batch_size!r}."
        )
    check_token_ids(queries, vocab_size, "`generate()`'s `query_tensor`")
    if max_new_tokens is not None:
        check_max_new_tokens(max_new_tokens, max(query.numel() for query in queries), context, "`max_new_tokens`")
    require_pad_token(pad_token_id, "`generate()` (it pads queries and responses)")


def check_generation_kwargs(kwargs: dict, vocab_size: int) -> None:
    """`generate()`'s keyword overrides checked as the config's own fields are: `temperature` a finite number > 0
    (0 is not greedy decoding here: it divides), `top_p` in (0, 1], `top_k` and `min_new_tokens` integers >= 0,
    `eos_token_id` / `pad_token_id` token ids (or lists of them) the policy has."""

    def fail(name: str, needed: str) -> None:
        raise ValueError(f"`generate()`'s `{name}` must be {needed}, got {kwargs[name]!r}.")

    def number(name: str) -> float | None:
        value = kwargs[name]
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
        return float(value) if ok else None

    if "temperature" in kwargs and not (number("temperature") or 0) > 0:
        fail("temperature", "a finite number > 0 (sampling divides the logits by it; for near-greedy use 1e-3)")
    if "top_p" in kwargs and not 0 < (number("top_p") or 0) <= 1:
        fail("top_p", "a number in (0, 1]")
    for name in ("top_k", "min_new_tokens"):  # a whole float too: TRL's tutorials pass `top_k=0.0`
        value = number(name) if name in kwargs else 0.0
        if value is None or value < 0 or not value.is_integer():
            fail(name, "an integer >= 0")
    for name in ("eos_token_id", "pad_token_id"):
        if kwargs.get(name) is None:
            continue
        ids = kwargs[name] if isinstance(kwargs[name], (list, tuple)) else [kwargs[name]]
        if not ids or any(isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < vocab_size
                          for i in ids):
            fail(name, f"a token id (or a list of them) in [0, {vocab_size}), the policy's vocabulary")


def check_max_new_tokens(max_new_tokens, longest_query: int, context: int | None, name: str) -> None:
    """A response length (`name` says where it came from) must be a positive integer, and with the longest query
    fit the model's `context`, as `train()` checks `response_length` against its prompts."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
        raise ValueError(f"`generate()`: {name} must be a positive integer (new tokens), got {max_new_tokens!r}.")
    if context is not None and longest_query + max_new_tokens > context:
        room = context - longest_query
        advice = f"lower it to at most {room}" if room > 0 else "shorten the query: it fills the context alone"
        raise ValueError(
            f"`generate()`: the longest query ({longest_query} tokens) and {name} ({max_new_tokens}) exceed the "
            f"model's context ({context} positions): {advice}."
        )


def check_token_lists(tensors: list, name: str) -> list[torch.Tensor]:
    """Each item as a 1-D long tensor; an empty one or another shape is an error naming its position."""
    checked = []
    for index, tensor in enumerate(tensors):
        try:
            tensor = torch.as_tensor(tensor)
        except (TypeError, ValueError, RuntimeError) as error:  # text, ragged lists, objects
            raise ValueError(
                f"`{name}[{index}]` must be a 1-D tensor of token ids, got {type(tensor).__name__} ({error}): "
                "tokenize the text first (e.g. `tokenizer(text, return_tensors='pt').input_ids[0]`)."
            ) from None
        if tensor.dtype == torch.bool:  # a mask passed by mistake: it would train on token ids 0 and 1
            raise ValueError(
                f"`{name}[{index}]` is a boolean tensor (a mask?); give the token ids (integers) instead."
            )
        if tensor.device.type == "meta":
            raise ValueError(f"`{name}[{index}]` is on the meta device, without values: give real token ids.")
        if tensor.dim() != 1 or tensor.numel() == 0 or tensor.is_floating_point():
            raise ValueError(
                f"`{name}[{index}]` must be a non-empty 1-D tensor of token ids, got shape {tuple(tensor.shape)} "
                f"and dtype {tensor.dtype}."
            )
        checked.append(tensor.long().cpu())  # one device for all (ids are moved to the model's by the caller)
    if not checked:
        raise ValueError(f"`{name}` is empty.")
    return checked


def scores_tensor(scores, caller: str = "`step()`") -> torch.Tensor:
    """Scores as a float32 `[B]` tensor; a score that is not one finite number within `MAX_ABS_SCORE` is an error
    naming `caller` (`step()`, or `log_stats()`'s rewards)."""
    if isinstance(scores, torch.Tensor):
        values = scores.detach().float().reshape(-1)
    else:
        for index, score in enumerate(scores):
            if not isinstance(score, (numbers.Real, torch.Tensor, np.generic, np.ndarray)):
                raise ValueError(
                    f"{caller}: score {index} is {score!r} ({type(score).__name__}): each score must be a number "
                    "(a float, or a one-element tensor)."
                )
        # Detached: a score computed by a trainable head must not carry the PPO loss's gradient back into it.
        scores = [torch.as_tensor(score).detach() for score in scores]
        if any(score.numel() != 1 for score in scores):
            raise ValueError(f"Each score given to {caller} must be a single number.")
        values = torch.stack([score.reshape(()).float() for score in scores]) if scores else torch.zeros(0)
    if not bool(torch.isfinite(values).all()):
        bad = values[~torch.isfinite(values)][0].item()
        raise ValueError(f"{caller} got a non-finite score ({bad}): scores must be finite numbers.")
    if bool((values.abs() > MAX_ABS_SCORE).any()):
        bad = values[values.abs() > MAX_ABS_SCORE][0].item()
        raise ValueError(
            f"{caller} got a score of {bad:g}, beyond ±{MAX_ABS_SCORE:g}: PPO squares scores (value loss, "
            "whitening), which overflows. Rescale the scores."
        )
    return values.cpu()

"""Scores: one number per episode, from a reward model or a reward function.

Every reward sits behind one signature: a rollout (plus decoded text) in, `[B]` scores out.
* A reward model is a sequence-classification model; it is read at the last response token.
* A reward function is any callable `f(prompts: list[str], completions: list[str], **columns) -> list[float]`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from . import ppo
from .models import check_scalar_head_model, scalar_head_outputs
from .rollout import Rollout, chunks

RewardFunction = Callable[..., list[float]]


def check_reward(reward: Any) -> None:
    """Fail before training when `reward` is neither a scoring model nor a callable."""
    if isinstance(reward, nn.Module):
        check_scalar_head_model(reward, "reward model")
    elif not callable(reward):
        raise TypeError(
            f"`reward_model` must be a sequence-classification model or a callable "
            f"`f(prompts, completions, **columns) -> list[float]`, got {type(reward).__name__}."
        )


def reward_name(reward: Any) -> str:
    return getattr(reward, "__name__", None) or type(reward).__name__


def decode_texts(tokenizer, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """Decode the masked tokens of each row, without special tokens."""
    return [tokenizer.decode(row[keep], skip_special_tokens=True) for row, keep in zip(ids, mask.bool())]


@torch.no_grad()
def reward_model_scores(reward_model: nn.Module, rollout: Rollout, chunk_size: int) -> torch.Tensor:
    """Reward model output at the last response token (the stop token when there is one). -> `[B]`."""
    last_index = rollout.queries.size(1) + rollout.response_mask.long().sum(-1).clamp(min=1) - 1
    input_ids, attention_mask = rollout.input_ids, rollout.attention_mask
    scores = []
    for part in chunks(input_ids.size(0), chunk_size):
        outputs = scalar_head_outputs(reward_model, input_ids[part], attention_mask[part])
        scores.append(outputs.gather(1, last_index[part].unsqueeze(1)).squeeze(1))
    return torch.cat(scores)


def reward_function_scores(
    reward_function: RewardFunction, prompts: list[str], completions: list[str], columns: dict[str, list], device
) -> torch.Tensor:
    """Call a reward function and check its answer. -> `[B]` float32."""
    name = reward_name(reward_function)
    values = list(reward_function(prompts=prompts, completions=completions, **columns))
    if len(values) != len(completions):
        raise ValueError(
            f"Reward function {name!r} returned {len(values)} scores for {len(completions)} completions: it must "
            "return one float per completion."
        )
    if any(value is None for value in values):
        raise ValueError(f"Reward function {name!r} returned None: it must return one float per completion.")
    return torch.tensor([float(v) for v in values], dtype=torch.float32, device=device)


def check_finite_scores(scores: torch.Tensor, reward: Any) -> torch.Tensor:
    """Raise, naming the reward, when a score is NaN or infinite (it would poison every later update)."""
    bad = ~torch.isfinite(scores)
    if bool(bad.any()):
        raise ValueError(
            f"Reward {reward_name(reward)!r} returned {int(bad.sum())} non-finite score(s) out of {scores.numel()} "
            f"(first: {scores[bad][0].item()}): make it return finite floats."
        )
    return scores


def compute_scores(
    reward: Any,
    rollout: Rollout,
    tokenizer,
    columns: dict[str, list],
    chunk_size: int,
    penalty_token_id: int | None,
    missing_eos_penalty: float | None,
) -> torch.Tensor:
    """Score every episode of `rollout`; subtract `missing_eos_penalty` from those without `penalty_token_id`
    (the stop token, or EOS without one). -> `[B]` float32.

    `columns` are the dataset's other columns for this batch, passed to reward functions as keyword lists.
    """
    if isinstance(reward, nn.Module):
        scores = reward_model_scores(reward, rollout, chunk_size).float()
    else:
        prompts = decode_texts(tokenizer, rollout.queries, rollout.query_mask)
        completions = decode_texts(tokenizer, rollout.responses, rollout.response_mask)
        scores = reward_function_scores(reward, prompts, completions, columns, rollout.responses.device)
    check_finite_scores(scores, reward)
    if missing_eos_penalty is not None and penalty_token_id is not None:
        has_stop = ppo.contains_stop_token(rollout.responses, rollout.response_mask, penalty_token_id)
        scores = ppo.apply_missing_eos_penalty(scores, has_stop, missing_eos_penalty)
    return scores

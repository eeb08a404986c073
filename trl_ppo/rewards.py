"""Scores: one number per episode, from any mix of reward models and reward functions.

Every reward sits behind one signature: a rollout (plus decoded text and the batch's other columns) in,
`[B]` scores out.
* A reward model is a sequence-classification model read at the last response token. With its own tokenizer
  (`reward_processing_class`) the decoded prompt and completion are re-encoded for it (through its chat
  template for conversational prompts); otherwise it reads the policy's token ids.
* A reward function is any callable `f(prompts, completions, **columns) -> list[float | None]`, plain or
  `async`; `None` means "no score" for that completion.
Several rewards are combined as a weighted sum (`reward_weights`); a missing score counts as 0 in that sum.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from . import ppo
from .data import is_conversational
from .deadlines import Deadlines, UserCallError
from .fsdp import root_call
from .models import check_scalar_head_model, scalar_head_outputs
from .reward_functions import RewardValueError, add_note, reward_function_scores
from .rollout import Rollout, chunks


@dataclass
class Reward:
    """One reward source with its name (for logs), weight and, for a model, an optional own tokenizer."""

    source: Any  # nn.Module or callable
    name: str
    weight: float = 1.0
    tokenizer: Any = None
    own_deadlines: bool = False  # a function whose calls into user code have their own (environments' `get_reward`)

    @property
    def is_model(self) -> bool:
        return isinstance(self.source, nn.Module)


def models_reading_policy_ids(rewards: list[Reward]) -> dict[str, nn.Module]:
    """The reward models without their own tokenizer (they read the policy's token ids), by argument name."""
    return {
        "reward_model" if len(rewards) == 1 else f"reward_model[{i}]": reward.source
        for i, reward in enumerate(rewards)
        if reward.is_model and reward.tokenizer is None
    }


def reward_name(reward: Any) -> str:
    return getattr(reward, "__name__", None) or type(reward).__name__


def build_rewards(reward_model, reward_weights=None, reward_processing_class=None, environments=False) -> list[Reward]:
    """Check and name the rewards given as `reward_model` (one, or a list mixing models and callables; None:
    no reward, for `step()` on given scores). An empty list is accepted with `environments` (an
    `environment_factory`, whose `get_reward` may be the only reward: `agents.runner.agent_runner` checks it)."""
    if reward_model is None:
        return []
    sources = list(reward_model) if isinstance(reward_model, (list, tuple)) else [reward_model]
    if not sources and not environments:
        raise ValueError("`reward_model` is an empty list: give at least one reward model or function.")
    for source in sources:
        if isinstance(source, nn.Module):
            check_scalar_head_model(source, "reward model")
        elif not callable(source):
            raise TypeError(
                f"`reward_model` must be a sequence-classification model or a callable "
                f"`f(prompts, completions, **columns) -> list[float]` (or a list of those), got "
                f"{type(source).__name__}."
            )
    weights = [1.0] * len(sources) if reward_weights is None else list(reward_weights)
    if len(weights) != len(sources):
        raise ValueError(f"`reward_weights` has {len(weights)} values for {len(sources)} rewards: give one per reward.")
    models = [source for source in sources if isinstance(source, nn.Module)]
    tokenizers = _tokenizers_per_model(reward_processing_class, len(models))
    names, rewards = set(), []
    for source, weight in zip(sources, weights):
        name = base = reward_name(source)
        suffix = 2
        while name in names:  # two rewards of the same class or name
            name, suffix = f"{base}_{suffix}", suffix + 1
        names.add(name)
        tokenizer = tokenizers.pop(0) if isinstance(source, nn.Module) else None
        rewards.append(Reward(source, name, float(weight), tokenizer))
    return rewards


def _tokenizers_per_model(reward_processing_class, num_models: int) -> list:
    if reward_processing_class is None:
        return [None] * num_models
    if not isinstance(reward_processing_class, (list, tuple)):
        reward_processing_class = [reward_processing_class]
    if len(reward_processing_class) != num_models:
        raise ValueError(
            f"`reward_processing_class` has {len(reward_processing_class)} tokenizers for {num_models} reward "
            "models: give one per reward model, in the same order (None for one that shares the policy's)."
        )
    for tokenizer in reward_processing_class:
        if tokenizer is not None and tokenizer.pad_token_id is None:
            raise ValueError("A `reward_processing_class` tokenizer has no pad token: set one before training.")
    return list(reward_processing_class)


def decode_texts(tokenizer, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """Decode the masked tokens of each row, without special tokens."""
    return [tokenizer.decode(row[keep], skip_special_tokens=True) for row, keep in zip(ids, mask.bool())]


# ------------------------------------------------------------------------------------------- reward models
@torch.no_grad()
def reward_model_scores(reward_model: nn.Module, rollout: Rollout, chunk_size: int) -> torch.Tensor:
    """Reward model output at the last response token (the stop token when there is one). -> `[B]`."""
    last_index = rollout.queries.size(1) + ppo.last_token_index(rollout.response_mask)
    return _scores_at(reward_model, rollout.input_ids, rollout.attention_mask, last_index, chunk_size)


@torch.no_grad()
def retokenized_scores(
    reward_model: nn.Module, tokenizer, texts: list[str], chunk_size: int, device, add_special_tokens: bool = True
) -> torch.Tensor:
    """Score whole texts encoded with the reward model's own tokenizer, read at each text's last token."""
    encoded = tokenizer(
        texts, padding=True, return_tensors="pt", padding_side="right", add_special_tokens=add_special_tokens
    )
    input_ids, attention_mask = encoded["input_ids"].to(device), encoded["attention_mask"].to(device)
    return _scores_at(reward_model, input_ids, attention_mask, attention_mask.sum(-1) - 1, chunk_size)


def _scores_at(model, input_ids, attention_mask, index, chunk_size: int) -> torch.Tensor:
    scores = []
    for part in chunks(input_ids.size(0), chunk_size):
        outputs = root_call(model, scalar_head_outputs, input_ids[part], attention_mask[part])  # FSDP2: one forward
        scores.append(outputs.gather(1, index[part].unsqueeze(1)).squeeze(1))
    return torch.cat(scores).float()


def texts_for_reward_tokenizer(tokenizer, texts: list[str], completions: list[str], prompt_column) -> list[str]:
    """What a reward model with its own tokenizer reads: the conversation rendered with that tokenizer's chat
    template when the prompts are chat messages (and it has a template), else `texts`, the prompt and response
    decoded together by the policy's tokenizer."""
    if uses_chat_template(tokenizer, prompt_column):
        return [
            tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": completion}], tokenize=False)
            for messages, completion in zip(prompt_column, completions)
        ]
    return texts


def uses_chat_template(tokenizer, prompt_column) -> bool:
    """Whether conversational prompts are rendered with `tokenizer`'s chat template (which writes its own
    special tokens, so none are added again when encoding)."""
    return bool(prompt_column) and is_conversational(prompt_column[0]) and tokenizer.chat_template is not None


# PPO squares scores (value loss, whitening), so float32 overflows near 1e19; far below that, no sane reward.
MAX_ABS_SCORE = 1e10


def check_finite_scores(scores: torch.Tensor, name: str) -> None:
    """Raise, naming the reward, when a score is NaN, infinite or beyond `MAX_ABS_SCORE` (it would poison every
    later update)."""
    bad = ~torch.isfinite(scores)
    if bool(bad.any()):
        raise RewardValueError(
            f"Reward {name!r} returned {int(bad.sum())} non-finite score(s) out of {scores.numel()} "
            f"(first: {scores[bad][0].item()}): make it return finite floats."
        )
    huge = scores.abs() > MAX_ABS_SCORE
    if bool(huge.any()):
        raise RewardValueError(
            f"Reward {name!r} returned {int(huge.sum())} score(s) beyond ±{MAX_ABS_SCORE:g} out of {scores.numel()} "
            f"(first: {scores[huge][0].item():g}): PPO squares scores (value loss, whitening), which overflows. "
            "Rescale the reward (e.g. a log or a division), or clip it in the function."
        )


# ----------------------------------------------------------------------------------------------- combined
def compute_scores(
    rewards: list[Reward],
    rollout: Rollout,
    tokenizer,
    columns: dict[str, list],
    chunk_size: int,
    penalty_token_id: int | None,
    missing_eos_penalty: float | None,
    deadlines: Deadlines | None = None,
) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Score every episode of `rollout` with every reward.

    Returns the combined scores `[B]` (weighted sum, minus `missing_eos_penalty` for responses without
    `penalty_token_id`) and, per reward name, `(scores [B], present [B])`: `present` is False where a reward
    function returned None (its score then counts as 0 in the sum), and None for a reward model.
    `columns` are the batch's other dataset columns, passed to reward functions as keyword lists; `deadlines`
    bound the reward functions' calls.
    """
    device = rollout.responses.device
    prompt_column = columns.get("prompt")
    if any(not reward.is_model or reward.tokenizer is not None for reward in rewards):
        prompts = decode_texts(tokenizer, rollout.queries, rollout.query_mask)
        completions = decode_texts(tokenizer, rollout.responses, rollout.response_mask)
    per_reward = {}
    for reward in rewards:
        present = None  # a reward model scores every episode
        if reward.is_model and reward.tokenizer is None:
            scores = reward_model_scores(reward.source, rollout, chunk_size)
        elif reward.is_model:
            full_texts = decode_texts(tokenizer, rollout.input_ids, rollout.attention_mask)
            texts = texts_for_reward_tokenizer(reward.tokenizer, full_texts, completions, prompt_column)
            templated = uses_chat_template(reward.tokenizer, prompt_column)  # the template wrote special tokens
            scores = retokenized_scores(
                reward.source, reward.tokenizer, texts, chunk_size, device, add_special_tokens=not templated
            )
        else:
            bounded = None if reward.own_deadlines else deadlines
            scores, present = reward_function_scores(
                reward.source, reward.name, prompts, completions, columns, device, bounded
            )
        check_finite_scores(scores if present is None else scores[present], reward.name)
        per_reward[reward.name] = (scores, present)
    combined = sum(reward.weight * per_reward[reward.name][0] for reward in rewards)
    if missing_eos_penalty is not None and penalty_token_id is not None:
        last_turn = ppo.last_turn_mask(rollout.response_mask)  # a multi-turn episode's earlier turns all stopped
        has_stop = ppo.contains_stop_token(rollout.responses, last_turn, penalty_token_id)
        combined = ppo.apply_missing_eos_penalty(combined, has_stop, missing_eos_penalty)
    return combined, per_reward


@dataclass(frozen=True)
class Scoring:
    """How a run scores its episodes: `compute_scores` with the run's rewards and settings, under the run's
    mixed precision, its errors labelled with where they happened."""

    rewards: list[Reward]
    tokenizer: Any  # the policy's
    chunk_size: int  # `local_rollout_forward_batch_size`
    penalty_token_id: int | None
    missing_eos_penalty: float | None
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    passed: tuple[str, ...] = ()  # arguments the trainer adds to the columns (`environments`)
    done: Callable[[dict], None] | None = None  # called with the batch once scored (closes its environments)
    deadlines: Deadlines | None = None  # on the reward functions' calls

    @classmethod
    def from_config(
        cls, rewards, tokenizer, args, penalty_token_id: int | None, autocast, passed=(), done=None
    ) -> "Scoring":
        chunk_size, penalty = args.local_rollout_forward_batch_size, args.missing_eos_penalty
        deadlines = Deadlines.from_config(args)
        return cls(rewards, tokenizer, chunk_size, penalty_token_id, penalty, autocast, passed, done, deadlines)

    def __call__(self, rollout: Rollout, batch: dict, where: str) -> tuple[torch.Tensor, dict]:
        """Scores `[B]` of the rollout of a collated `batch` (its other columns go to reward functions) and,
        per reward name, `(scores [B], present [B] or None)`. A reward's error is prefixed with `where`. The
        batch's episodes end here: `done(batch)` is called, scored or not."""
        columns = {key: value for key, value in batch.items() if key not in ("input_ids", "attention_mask")}
        with self.autocast(), _labelled_errors(where), self._finally_done(batch):
            return compute_scores(
                self.rewards,
                rollout,
                self.tokenizer,
                columns,
                self.chunk_size,
                self.penalty_token_id,
                self.missing_eos_penalty,
                self.deadlines,
            )


    @contextlib.contextmanager
    def _finally_done(self, batch: dict):
        try:
            yield
        finally:
            if self.done is not None:
                self.done(batch)


@contextlib.contextmanager
def _labelled_errors(where: str):
    """Prefix a reward error (`ValueError`) with where it happened, e.g. "Update 3"; any other error raised while
    scoring (a bug in a reward function) keeps its type and gets a note saying where."""
    try:
        yield
    except RewardValueError as error:  # what a reward returned: kept apart from a ValueError a reward raised
        raise RewardValueError(f"{where}: {error}") from error
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from error
    except UserCallError as error:  # a reward function that timed out: where the run stopped
        raise UserCallError(f"{where}: {error}") from error
    except Exception as error:
        add_note(error, f"{where}, while scoring.")
        raise

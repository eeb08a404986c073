"""Reward functions: plain or `async` callables `f(prompts, completions, **columns) -> list[float | None]`, called
by keyword with what they name out of the batch, bounded by `reward_timeout` (`deadlines.py`), and their results
checked (one number or None per completion). `rewards.py` combines them with reward models."""

from __future__ import annotations

import copy
import inspect
import numbers
import reprlib
from typing import Any, Callable

import torch

from . import async_loop
from . import distributed as dist
from .deadlines import Deadlines, UserCallError

RewardFunction = Callable[..., list]


def call_reward_function(reward_function: RewardFunction, **kwargs) -> list:
    """Call a reward function; an `async` one (e.g. an HTTP judge scoring completions concurrently) is awaited on
    the run's event loop (`async_loop`), where the environments it reads made their async state."""
    return async_loop.resolve(reward_function(**kwargs))


class RewardValueError(ValueError):
    """A reward returned what cannot be scores: another number of values than completions, something that is not a
    number or None, NaN, infinity or a score beyond ±1e10. The values are the problem, not a line of trl_ppo, so
    `trl-ppo` shows it as its one-line message, without a traceback."""


def reward_values(result, name: str, count: int) -> list:
    """What reward function `name` returned for `count` completions, checked: a list (or 1-D tensor or array)
    of numbers (0-d tensors too) and Nones, one per completion; anything else raises, naming what it was."""
    if hasattr(result, "ndim") and hasattr(result, "tolist") and result.ndim == 1:
        result = result.tolist()
    if not isinstance(result, (list, tuple)):
        wrong = f"{type(result).__name__} {reprlib.repr(result)}, not a list"
    else:
        result = [v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v for v in result]
        bad = [(i, v) for i, v in enumerate(result) if v is not None and not isinstance(v, numbers.Real)]
        wrong = f"{len(result)} scores" if len(result) != count else None
        if bad:
            index, value = bad[0]
            wrong = f"{type(value).__name__} {reprlib.repr(value)} at position {index} (of {len(result)} values)"
    if wrong is not None:
        raise RewardValueError(
            f"Reward function {name!r} returned {wrong}: it must return a list of one float (or None) per "
            f"completion, {count} here."
        )
    return result


def reward_arguments(
    reward_function: RewardFunction, name: str, available: dict[str, Any], source: str = "the batch"
) -> dict[str, Any]:
    """The keyword arguments `reward_function` takes, out of `available` (`prompts`, `completions` and the
    columns of `source`): all of them for a function with `**kwargs`, else only the ones it names, so
    `lambda prompts, completions: ...` works. A parameter it requires that is not available is an error naming
    the reward. Each data value is a copy: a reward that mutates its lists cannot change what the next one sees;
    `environments` are the episodes' live instances, passed as they are (a reward reads their state, and an
    environment may hold a lock, a socket or a process that cannot be copied)."""
    try:
        parameters = inspect.signature(reward_function).parameters.values()
    except (TypeError, ValueError):  # no signature to read (some builtins): give it everything
        parameters = [inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)]
    named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    required = [p.name for p in parameters if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    missing = [parameter for parameter in required if parameter not in named or parameter not in available]
    if missing:
        columns = [key for key in available if key not in ("prompts", "completions")]
        environments = " `environments` is passed with an `environment_factory`." if "environments" in missing else ""
        raise ValueError(
            f"Reward function {name!r} requires {', '.join(map(repr, missing))}, which the trainer cannot pass: it "
            f"calls rewards by keyword with `prompts`, `completions` and the other columns of {source} "
            f"({', '.join(columns) or 'none'}). Name its parameters after those, give the others defaults, or add "
            f"`**columns`.{environments}"
        )
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return copied_arguments(available)
    return copied_arguments({key: value for key, value in available.items() if key in named})


LIVE_ARGUMENTS = ("environments",)  # passed by reference, never copied


def copied_arguments(arguments: dict[str, Any]) -> dict[str, Any]:
    return {key: value if key in LIVE_ARGUMENTS else copy.deepcopy(value) for key, value in arguments.items()}


def check_reward_columns(rewards: list, dataset, name: str, passed: tuple[str, ...] = ()) -> None:
    """Before any compute: every reward function can be called with what a batch of `dataset` gives it, and the
    `passed` arguments the trainer adds (`environments`, with an `environment_factory`)."""
    if dataset is None:
        return
    columns = [column for column in dataset.column_names if column not in ("input_ids", "attention_mask")]
    available = dict.fromkeys(["prompts", "completions", *columns, *passed])
    for reward in rewards:
        if not reward.is_model:
            reward_arguments(reward.source, reward.name, available, f"`{name}`")


def reward_function_scores(
    reward_function: RewardFunction,
    name: str,
    prompts: list[str],
    completions: list[str],
    columns: dict,
    device,
    deadlines: Deadlines | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (scores `[B]` with 0 where missing, present `[B]` bool: False where the function returned None). With
    `deadlines`, the call is bounded by `reward_timeout` and retried (`Deadlines.call`). Every process learns
    whether the others' calls succeeded: where one failed, all raise (none waits in the next collective)."""
    arguments = reward_arguments(reward_function, name, {"prompts": prompts, "completions": completions, **columns})

    def scored() -> list:
        try:
            if deadlines is None:
                result = call_reward_function(reward_function, **arguments)
            else:
                call = lambda: reward_function(**arguments)  # noqa: E731
                result = deadlines.call(call, f"Reward function {name!r}", deadlines.reward, "reward_timeout")
        except ValueError as error:  # labelled with the update by `Scoring`, which re-raises ValueErrors
            raise ValueError(f"Reward function {name!r} raised: {error}") from error
        except Exception as error:
            add_note(error, f"Raised by reward function {name!r}.")
            raise
        return reward_values(result, name, len(completions))

    what = f"reward function {name!r}"
    values = dist.checked_on_every_process(scored, device, what, (Exception,), "failed", UserCallError)
    present = torch.tensor([value is not None for value in values], dtype=torch.bool, device=device)
    scores = torch.tensor([0.0 if v is None else float(v) for v in values], dtype=torch.float32, device=device)
    return scores, present


def add_note(error: Exception, note: str) -> None:
    if hasattr(error, "add_note"):  # Python >= 3.11; on 3.10 the traceback still shows the function
        error.add_note(note)

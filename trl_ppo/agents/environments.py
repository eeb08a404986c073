"""Environments: one instance per episode, made by `environment_factory` (a class or a function returning an
environment, or `{name: either}` picked by each row's `environment` column). `reset(**row)` starts the episode (a
returned string is added to the prompt); its public methods are the episode's tools (`tools.public_methods`); an
optional `get_reward()` is added to the episode's score; an optional `close()` is called once the episode is scored
(TRL 1.12 has no such hook: it reuses its instances). `reset`, `get_reward` and `close` may be `async def`: they are
awaited on the run's event loop, the one the async tools run on.

Each call is bounded by `environment_timeout` (`deadlines.py`): making and resetting an environment, and
`get_reward`, are retried when they pass it or raise a transient error, then stop the run naming the method; a batch's
`close()` calls run side by side under one deadline, and one that passes it is abandoned with a warning."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping

from transformers.utils import logging

from .. import async_loop
from ..deadlines import TIMED_OUT, Deadlines, Failed, call_all_within, describe

logger = logging.get_logger(__name__)

ROUTING_COLUMN = "environment"


class Environments:
    """`environment_factory` checked once, at construction; `create(row)` makes one episode's environment."""

    def __init__(self, factory, columns: list[str] | None = None, deadlines: Deadlines | None = None) -> None:
        if isinstance(factory, Mapping):
            if not factory:
                raise ValueError("`environment_factory` is an empty dict: give at least one `{name: class}`.")
            for name, maker in factory.items():
                _check_maker(maker, f"`environment_factory[{name!r}]`")
            if columns is not None and ROUTING_COLUMN not in columns:
                raise ValueError(
                    f"`environment_factory` is a dict of {len(factory)} environments ({sorted(factory)}), so each "
                    f"row needs an `{ROUTING_COLUMN}` column naming one; the dataset's columns are {columns}."
                )
        else:
            _check_maker(factory, "`environment_factory`")
        self.factory, self.deadlines = factory, deadlines

    def create(self, row: Mapping) -> tuple[object, str | None]:
        """The episode's environment for a dataset `row`, reset with the row's columns -> (environment, the text
        `reset` returned to add to the prompt, or None)."""
        maker, where = self.factory, "`environment_factory`"
        if isinstance(self.factory, Mapping):
            name = row.get(ROUTING_COLUMN)
            if name not in self.factory:
                raise ValueError(
                    f"A row's `{ROUTING_COLUMN}` is {name!r}, which `environment_factory` does not name "
                    f"(it has {sorted(self.factory)})."
                )
            maker, where = self.factory[name], f"`environment_factory[{name!r}]`"

        def make_and_reset():  # a retry makes a new environment: the one abandoned may still be running
            environment = make_environment(maker, where)
            added = environment.reset(**row) if hasattr(environment, "reset") else None
            return _awaiting_second(environment, added) if inspect.isawaitable(added) else (environment, added)

        if self.deadlines is None:
            environment, added = async_loop.resolve(make_and_reset())
        else:
            name = f"`{getattr(maker, '__name__', type(maker).__name__)}.reset`"
            seconds = self.deadlines.environment
            environment, added = self.deadlines.call(make_and_reset, name, seconds, "environment_timeout")
        if added is not None and not isinstance(added, str):
            raise TypeError(
                f"`{type(environment).__name__}.reset` returned {type(added).__name__}; it may return a string "
                "(added to the prompt) or None."
            )
        return environment, added


async def _awaiting_second(first, awaitable) -> tuple:
    return first, await awaitable


def _check_maker(maker, where: str) -> None:
    if not callable(maker):
        raise TypeError(f"{where} must be a class (or a callable returning an environment), got {maker!r}.")


def make_environment(maker: Callable, where: str):
    """`maker()`, refused when it returns None (a function that forgot its `return`)."""
    environment = maker()
    if environment is None:
        raise TypeError(
            f"{where} returned None: it must return the environment (a class, or a function ending in "
            "`return Env(...)`)."
        )
    return environment


def close_environments(environments: list, seconds: float | None = None) -> None:
    """Call each environment's optional `close()` (awaited when async), side by side, within `seconds` together
    (None: no limit). A failure, or a call still running then (abandoned), is logged, not raised: the episode is
    over, and a run is not stopped for what it could not release."""
    closing = [environment for environment in environments if callable(getattr(environment, "close", None))]
    outcomes = call_all_within([environment.close for environment in closing], seconds)
    for environment, outcome in zip(closing, outcomes):
        if isinstance(outcome, Failed) or outcome is TIMED_OUT:
            abandoned = " (stopped: a sync one blocked in C runs on in its thread)" if outcome is TIMED_OUT else ""
            logger.warning(f"`{type(environment).__name__}.close()` {describe(outcome, seconds)}{abandoned}")


def close_environment(environment) -> None:
    """`close_environments` of one environment, without a limit."""
    close_environments([environment])


def environment_reward(environment, deadlines: Deadlines | None = None) -> float:
    """The environment's `get_reward()` (0 without one), bounded and retried by `deadlines` (`environment_timeout`);
    a value that is not a finite number is an error."""
    get_reward: Callable | None = getattr(environment, "get_reward", None)
    if get_reward is None:
        return 0.0
    if deadlines is None:
        returned = async_loop.resolve(get_reward())
    else:
        name = f"`{type(environment).__name__}.get_reward`"
        returned = deadlines.call(get_reward, name, deadlines.environment, "environment_timeout")
    try:
        value = float(returned)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(
            f"`{type(environment).__name__}.get_reward()` returned {returned!r}: it must return a finite number."
        )
    return value

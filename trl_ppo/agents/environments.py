"""Environments: one instance per episode, made by `environment_factory` (a class or a function returning an
environment, or `{name: either}` picked by each row's `environment` column). `reset(**row)` starts the episode (a
returned string is added to the prompt); its public methods are the episode's tools (`tools.public_methods`); an
optional `get_reward()` is added to the episode's score; an optional `close()` is called once the episode is scored
(TRL 1.12 has no such hook: it reuses its instances). `reset`, `get_reward` and `close` may be `async def`: they are
awaited on the run's event loop, the one the async tools run on."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from transformers.utils import logging

from .. import async_loop

logger = logging.get_logger(__name__)

ROUTING_COLUMN = "environment"


class Environments:
    """`environment_factory` checked once, at construction; `create(row)` makes one episode's environment."""

    def __init__(self, factory, columns: list[str] | None = None) -> None:
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
        self.factory = factory

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
        environment = make_environment(maker, where)
        added = async_loop.resolve(environment.reset(**row)) if hasattr(environment, "reset") else None
        if added is not None and not isinstance(added, str):
            raise TypeError(
                f"`{type(environment).__name__}.reset` returned {type(added).__name__}; it may return a string "
                "(added to the prompt) or None."
            )
        return environment, added


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


def close_environment(environment) -> None:
    """Call the environment's optional `close()` (awaited when async). A failure is logged, not raised: the episode
    is over, and a run is not stopped for what it could not release."""
    close = getattr(environment, "close", None)
    if not callable(close):
        return
    try:
        async_loop.resolve(close())
    except Exception as error:
        logger.warning(f"`{type(environment).__name__}.close()` raised {type(error).__name__}: {error}")


def environment_reward(environment) -> float:
    """The environment's `get_reward()` (0 without one); a value that is not a finite number is an error."""
    get_reward: Callable | None = getattr(environment, "get_reward", None)
    if get_reward is None:
        return 0.0
    returned = async_loop.resolve(get_reward())
    try:
        value = float(returned)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(
            f"`{type(environment).__name__}.get_reward()` returned {returned!r}: it must return a finite number."
        )
    return value

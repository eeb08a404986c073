"""Environments: one instance per episode, made by `environment_factory` (a class, or `{name: class}` picked by
each row's `environment` column). `reset(**row)` starts the episode (a returned string is added to the prompt);
its public methods are the episode's tools (`tools.public_methods`); an optional `get_reward()` is added to the
episode's score."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

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
        maker = self.factory
        if isinstance(self.factory, Mapping):
            name = row.get(ROUTING_COLUMN)
            if name not in self.factory:
                raise ValueError(
                    f"A row's `{ROUTING_COLUMN}` is {name!r}, which `environment_factory` does not name "
                    f"(it has {sorted(self.factory)})."
                )
            maker = self.factory[name]
        environment = maker()
        added = environment.reset(**row) if hasattr(environment, "reset") else None
        if added is not None and not isinstance(added, str):
            raise TypeError(
                f"`{type(environment).__name__}.reset` returned {type(added).__name__}; it may return a string "
                "(added to the prompt) or None."
            )
        return environment, added


def _check_maker(maker, where: str) -> None:
    if not callable(maker):
        raise TypeError(f"{where} must be a class (or a callable returning an environment), got {maker!r}.")


def environment_reward(environment) -> float:
    """The environment's `get_reward()` (0 without one); a value that is not a finite number is an error."""
    get_reward: Callable | None = getattr(environment, "get_reward", None)
    if get_reward is None:
        return 0.0
    returned = get_reward()
    try:
        value = float(returned)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(
            f"`{type(environment).__name__}.get_reward()` returned {returned!r}: it must return a finite number."
        )
    return value

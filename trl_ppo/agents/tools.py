"""Tools: plain functions (sync or `async def`) and the public methods of an episode's environment, each with the
JSON schema that chat templates take (`apply_chat_template(..., tools=...)`), made by transformers' own
`get_json_schema` from type hints and the docstring (a description, and `Args:` for every parameter), or given by
the function itself as its `tool_schema` attribute (a tool whose schema comes from elsewhere: an MCP server's)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from transformers.utils import get_json_schema

from ..async_loop import is_async_callable


@dataclass(frozen=True)
class Tool:
    """A callable the model may call by `name`, and the JSON schema its chat template lists it with."""

    name: str
    function: Callable
    schema: dict

    @property
    def is_async(self) -> bool:
        """Awaited on the run's loop: an `async def` function or method, or an object with an `async __call__` (a
        client of a tool server, given with its `tool_schema`); called as it is, such an object would answer the
        model with an unawaited coroutine."""
        return is_async_callable(self.function)


def make_tool(function: Callable, where: str) -> Tool:
    """`function` as a `Tool`; one whose schema cannot be made is an error naming it and saying what to add."""
    if not callable(function):
        raise TypeError(f"{where}: {function!r} is not callable; tools are functions (sync or `async def`).")
    name = getattr(function, "__name__", repr(function))
    given = getattr(function, "tool_schema", None)
    if isinstance(given, dict) and isinstance(given.get("function"), dict) and "name" in given["function"]:
        return Tool(given["function"]["name"], function, given)
    try:
        schema = get_json_schema(function)
    except Exception as error:  # transformers raises a few kinds (no docstring, undocumented argument, no hint)
        raise ValueError(
            f"{where}: cannot describe the tool `{name}` to the model ({error}). A tool needs a type hint for "
            "every parameter and a Google-style docstring: a one-line description, then `Args:` with one line per "
            "parameter."
        ) from error
    return Tool(schema["function"]["name"], function, schema)


NOT_TOOLS = ("reset", "get_reward", "close")  # what the trainer calls, never the model


def public_methods(instance) -> list[Callable]:
    """The tools an environment offers: its public bound methods, as TRL takes them (`inspect.ismethod`), except
    `reset`, `get_reward` and `close`. Static methods, callable class attributes and classes are not tools, and no
    property is read to find them."""
    methods = []
    for name in dir(instance):
        if name.startswith("_") or name in NOT_TOOLS:
            continue
        if isinstance(inspect.getattr_static(instance, name), (property, functools.cached_property)):
            continue  # reading it would run its code
        member = getattr(instance, name)
        if inspect.ismethod(member):
            methods.append(member)
    return methods


def tool_list(functions, where: str = "`tools`") -> list[Callable]:
    """`tools` as a list; a single function (`tools=multiply`) or another non-list is an error saying the fix."""
    if callable(functions) or isinstance(functions, (str, bytes)) or not isinstance(functions, (Sequence, set)):
        if callable(functions):
            shown = getattr(functions, "__name__", repr(functions))
            raise TypeError(f"{where} must be a list of functions, got {shown!r}: pass `tools=[{shown}]`.")
        raise TypeError(f"{where} must be a list of functions, got a {type(functions).__name__}: pass a list.")
    return list(functions)


def toolbox(functions: Sequence[Callable], environment=None, where: str = "`tools`") -> dict[str, Tool]:
    """{name: Tool} of the plain `functions` and the `environment`'s public methods; two tools with one name are
    an error (the model could not tell them apart)."""
    tools: dict[str, Tool] = {}
    named = [(function, where) for function in tool_list(functions, where)]
    if environment is not None:
        get_reward = getattr(environment, "get_reward", None)
        if get_reward is not None and not callable(get_reward):
            raise TypeError(
                f"`environment_factory` ({type(environment).__name__}): its `get_reward` is {get_reward!r}, not a "
                "method; define `def get_reward(self) -> float` returning the episode's reward, or leave it out."
            )
        source = f"`environment_factory` ({type(environment).__name__})"
        named += [(method, source) for method in public_methods(environment)]
    for function, source in named:
        tool = make_tool(function, source)
        if tool.name in tools:
            raise ValueError(
                f"{source}: two tools are named `{tool.name}`; the model calls tools by name, so rename one."
            )
        tools[tool.name] = tool
    return tools


def schemas(tools: dict[str, Tool]) -> list[dict]:
    """The tools' JSON schemas, in the order given: what `apply_chat_template(..., tools=...)` takes."""
    return [tool.schema for tool in tools.values()]

"""OpenEnv environments as trl_ppo environments: `openenv_environment(url)` -> an `environment_factory` class whose
instances play one episode each in a session of their own on an OpenEnv server (its WebSocket, `/ws`).

* `reset(**row)` opens the session and resets it with the row's columns (the server keeps those its `reset` takes);
  the first observation, as text (`render`), is added to the prompt.
* The model's tool calls are the server's `step`s. An MCP environment's tools are listed once, when the class is
  made, and offered to the model with the server's own JSON schemas; another environment gets one tool, named after
  its action class (`GuessAction` -> `guess`), whose arguments are the action's fields (the server's `/schema`).
* Each step's `reward` is the reward of the turn that called it; `done` ends the episode (`environment.done`).
* `get_reward()` is 0 (the rewards came per turn) and reads the session's final `state`; with `observations`,
  `rewards` and `metadata` (the last observation's), reward functions that take `environments` read it.
* `close()` closes the session (the trainer calls it once the episode is scored, also after errors).

Failures: a server that cannot be reached, or a session lost during an episode, raise `ConnectionError` from
`reset` or `get_reward`, which are retried (`user_call_retries`) and then stop the run with `UserCallError` naming
the server, the last checkpoint intact; a server at capacity is refused at once, naming its capacity. A step past
`tool_timeout` ends the episode (the session is closed: its answer would come out of turn).
Needs the `openenv` extra; nothing here is imported by trl_ppo itself.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, Callable

from .. import async_loop
from .openenv_server import get_json

SKIPPED_COLUMNS = ("prompt", "messages", "input_ids", "attention_mask", "environment")
# The names of an episode's own members: a server's tool may not take one.
MEMBERS = ("reset", "get_reward", "close", "state", "done", "ended", "lost", "in_flight", "observations", "rewards",
           "metadata", "client", "url", "render", "message_timeout")  # fmt: skip


class ServerAtCapacityError(RuntimeError):
    """The OpenEnv server holds as many sessions as it may (`max_concurrent_envs`): the run plays more episodes at
    once than it allows."""


def render(observation: dict) -> str:
    """An observation as the model reads it: its one text field, else its fields as JSON (without `reward`, `done`
    and `metadata`; the metadata's when it has nothing else)."""
    fields = {k: v for k, v in observation.items() if k not in ("reward", "done", "metadata")}
    fields = fields or dict(observation.get("metadata") or {})
    texts = [value for value in fields.values() if isinstance(value, str)]
    if len(fields) == 1 and len(texts) == 1:
        return texts[0]
    return json.dumps(fields, sort_keys=True, default=str)


def mcp_answer(observation: dict) -> str:
    """A `CallToolObservation` as the model reads it; a tool's error raises (the model reads it as an error)."""
    error = observation.get("error")
    if error:
        raise RuntimeError(error.get("message") if isinstance(error, dict) else str(error))
    result = observation.get("result") or {}
    if result.get("data") is not None:
        data = result["data"]
        return data if isinstance(data, str) else json.dumps(data, default=str)
    return "".join(item.get("text", "") for item in result.get("content") or [] if isinstance(item, dict))


class OpenEnvEpisode:
    """One episode in a session of its own on an OpenEnv server (`openenv_environment` makes the class: `url`,
    `render` and the tools are set on it)."""

    url: str = ""
    render: Callable[[dict], str] = staticmethod(render)
    message_timeout: float = 3600.0  # trl_ppo's deadlines bound every call; the client's own is only a backstop

    def __init__(self) -> None:
        self.client = None
        self.ended, self.lost, self.in_flight = False, None, 0
        self.observations: list[dict] = []
        self.rewards: list[float] = []
        self.metadata: dict = {}
        self.state: dict | None = None

    async def reset(self, **row) -> str | None:
        from openenv.core import GenericEnvClient

        self.client = GenericEnvClient(base_url=self.url, message_timeout_s=self.message_timeout)
        arguments = {k: v for k, v in row.items() if k not in SKIPPED_COLUMNS and _is_json(v)}
        try:
            result = await self.client.reset(**arguments)
        except Exception as error:
            await self.close()
            _raise_named(error, self.url, "reset")
        self._observe(result, step=False)
        text = self.render(result.observation)
        return text or None

    @property
    def done(self) -> bool:
        """Whether the episode is over: the server said so, its session was lost, or a step never answered (past
        `tool_timeout`: a late answer would come out of turn on this session)."""
        return self.ended or self.in_flight > 0

    async def _step(self, action: dict):
        """One step -> (the observation, its reward); an episode whose session is lost or timed out ends."""
        if self.done:
            raise RuntimeError("the episode is over: no more actions are taken.")
        self.in_flight += 1
        try:
            result = await self.client.step(action)
        except asyncio.CancelledError:
            self.lost = "timed out"
            await asyncio.shield(self.close())
            raise
        except Exception as error:  # the server's own errors (an invalid action) are answers; a lost session ends it
            self.in_flight -= 1
            if _session_lost(error):
                self.ended, self.lost = True, f"{type(error).__name__}: {error}"
                await self.close()
            raise
        self.in_flight -= 1
        self._observe(result)
        return result.observation, float(result.reward or 0.0)

    def _observe(self, result, step: bool = True) -> None:
        """Keep what the server answered: `observations` from `reset`'s on, `rewards` one per step."""
        self.observations.append(result.observation)
        if step:
            self.rewards.append(float(result.reward or 0.0))
        self.metadata = dict(result.observation.get("metadata") or result.metadata or {})
        self.ended = self.ended or bool(result.done)

    async def get_reward(self) -> float:
        """0.0: the server's rewards were the turns'. Reads the session's final `state` first; an episode whose
        session was lost (not timed out) raises `ConnectionError`: its turns cannot be trusted."""
        if self.lost and self.lost != "timed out":  # (a timed-out step: counted in `env/tool_timeouts`, not fatal)
            raise ConnectionError(f"the session with the OpenEnv server at {self.url} was lost during the episode "
                                  f"({self.lost}).")  # fmt: skip
        if self.client is not None and self.state is None and not self.lost:
            try:
                self.state = await self.client.state()
            except Exception as error:
                _raise_named(error, self.url, "state")
        return 0.0

    async def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            try:
                await client.close()
            except Exception as error:  # the session is gone with the server: nothing left to close
                if not _session_lost(error):
                    raise


def _is_json(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _session_lost(error: BaseException) -> bool:
    """Whether `error` means the connection is gone (refused, reset, closed, timed out), not an error the server
    answered with (an invalid action), after which its session goes on."""
    closed = any(cls.__name__.startswith("ConnectionClosed") for cls in type(error).__mro__)  # websockets'
    return closed or isinstance(error, (ConnectionError, OSError))


def _raise_named(error: Exception, url: str, what: str) -> None:
    named = _named(error, url, what)
    if named is error:
        raise error
    raise named from error


def _named(error: Exception, url: str, what: str) -> Exception:
    """`error` of a call to the server at `url`, named: a lost connection as `ConnectionError` (retried), a server
    at capacity as `ServerAtCapacityError` (not retried), another error of the server's as it was."""
    message = str(error)
    if "CAPACITY_REACHED" in message:
        return ServerAtCapacityError(
            f"The OpenEnv server at {url} is at capacity ({message}): the run plays more episodes at once than it "
            "holds sessions. Start it with a larger `max_concurrent_envs` (at least the episodes of one batch on "
            "every process, with `SUPPORTS_CONCURRENT_SESSIONS = True` on the environment class), or play fewer."
        )
    if _session_lost(error):
        return ConnectionError(f"the OpenEnv server at {url} failed at `{what}`: {type(error).__name__}: {message}")
    return error


def _tool_name(title: str) -> str:
    """`GuessAction` -> `guess`; `MoveRobotAction` -> `move_robot`."""
    stem = re.sub(r"Action$", "", title) or "act"
    return re.sub(r"(?<!^)(?=[A-Z])", "_", stem).lower()


def _typed_tool(schema: dict) -> tuple[str, Callable]:
    """The one tool of an environment with typed actions: its action's fields as arguments."""
    name = _tool_name(schema.get("title", "Act"))
    properties = {k: v for k, v in schema.get("properties", {}).items() if k != "metadata"}
    parameters = {"type": "object", "properties": properties, "required": schema.get("required", [])}

    async def act(self, **arguments) -> tuple[str, float]:
        observation, reward = await self._step(arguments)
        return self.render(observation), reward

    description = schema.get("description") or "Take an action in the environment."
    act.tool_schema = {"type": "function", "function": {"name": name, "description": description,
                                                        "parameters": parameters}}  # fmt: skip
    return name, act


def _mcp_tool(tool: dict) -> tuple[str, Callable]:
    """A tool an MCP environment listed, called as a `call_tool` step."""
    name = tool["name"]

    async def call(self, **arguments) -> tuple[str, float]:
        observation, reward = await self._step({"type": "call_tool", "tool_name": name, "arguments": arguments})
        return mcp_answer(observation), reward

    call.tool_schema = {"type": "function", "function": {
        "name": name, "description": tool.get("description") or name,
        "parameters": tool.get("input_schema") or {"type": "object", "properties": {}}}}  # fmt: skip
    return name, call


async def _listed_tools(url: str) -> list[dict]:
    from openenv.core import GenericEnvClient

    client = GenericEnvClient(base_url=url)
    try:
        await client.reset()
        result = await client.step({"type": "list_tools"})
    finally:
        await client.close()
    return result.observation.get("tools") or []


def openenv_environment(url: str, render: Callable[[dict], str] | None = None, name: str | None = None) -> type:
    """The `environment_factory` for the OpenEnv server at `url` (`http://host:port`, or an `OpenEnvServer`):
    a class, one instance per episode, one session each (see the module). `render(observation) -> str`: how an
    observation reads to the model (default: its one text field, or its fields as JSON). The server is asked for
    its schema (and an MCP environment for its tools) here, once."""
    url = getattr(url, "url", url).rstrip("/")
    try:
        action = get_json(f"{url}/schema")["action"]
    except OSError as error:
        raise ConnectionError(f"No OpenEnv server answers at {url} ({error}): start it, or check the address.") \
            from error
    mcp = "tool_name" in action.get("properties", {})
    tools = [_mcp_tool(tool) for tool in async_loop.run(_listed_tools(url))] if mcp else [_typed_tool(action)]
    reserved = [tool for tool, _ in tools if tool in MEMBERS or tool.startswith("_")]
    if reserved:
        raise ValueError(f"The OpenEnv server at {url} has tools named {reserved}, names trl_ppo's episodes use.")
    members: dict[str, Any] = {"url": url, **dict(tools)}
    if render is not None:
        members["render"] = staticmethod(render)
    return type(name or "OpenEnvEpisode", (OpenEnvEpisode,), members)

"""Two small OpenEnv environments shipped to train on (pure Python, no Docker; the `openenv` extra), each served by
`OpenEnvServer` or `python -m trl_ppo.agents.openenv_server --environment trl_ppo.agents.openenv_envs:<Class>`.

* `ArithmeticEnvironment` (MCP tools): "What is (a * b) + c?"; tools `multiply`, `add` and `answer`; `answer`
  pays 1.0 for the right value (0.0 otherwise) and ends the episode. `reset(a=, b=, c=)` fixes the problem, else it
  is drawn from `seed`.
* `GuessEnvironment` (typed actions and a reward per step): a hidden number from 1 to 8 (`reset(target=)`, else
  drawn from `seed`), `GuessAction(number)` answered "higher", "lower" or "correct"; a step pays 1.0 when correct,
  else -0.1, and the game ends when the number is found or after `max_guesses` (3) guesses.
"""

from __future__ import annotations

import random
from typing import Any, Optional

from fastmcp import FastMCP
from openenv.core.env_server import Action, CallToolObservation, Environment, Observation, State
from openenv.core.env_server.mcp_environment import MCPEnvironment
from pydantic import Field


class ArithmeticState(State):
    problem: list[int] = Field(default_factory=list)
    answered: Optional[int] = None


class ArithmeticEnvironment(MCPEnvironment):
    """`(a * b) + c` with a calculator's tools; `answer` scores it."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        tools = FastMCP("arithmetic")

        @tools.tool
        def multiply(a: int, b: int) -> int:
            """Multiply two integers.

            Args:
                a: the first factor.
                b: the second factor.
            """
            return a * b

        @tools.tool
        def add(a: int, b: int) -> int:
            """Add two integers.

            Args:
                a: the first term.
                b: the second term.
            """
            return a + b

        @tools.tool
        def answer(value: int) -> str:
            """Give the final answer; this ends the episode.

            Args:
                value: the answer.
            """
            self._state.answered = value
            return "recorded"

        super().__init__(tools)
        self._state = ArithmeticState()

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, a: Optional[int] = None,
              b: Optional[int] = None, c: Optional[int] = None, **kwargs: Any) -> Observation:  # fmt: skip
        draw = random.Random(seed)
        problem = [v if v is not None else draw.randint(low, high) for v, low, high in
                   ((a, 2, 9), (b, 2, 9), (c, 1, 20))]  # fmt: skip
        self._state = ArithmeticState(episode_id=episode_id, problem=problem)
        return Observation(metadata={"question": f"What is ({problem[0]} * {problem[1]}) + {problem[2]}?"})

    def _scored(self, observation: Observation) -> Observation:
        """The step's reward and end: 1.0 for the right answer, the episode over once answered."""
        if not isinstance(observation, CallToolObservation):  # the tools listed: not a step of the episode
            return observation
        self._state.step_count += 1
        answered = observation.tool_name == "answer" and observation.error is None
        if answered:
            a, b, c = self._state.problem
            observation.done = True
        observation.reward = float(answered and self._state.answered == a * b + c)
        return observation

    def step(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        return self._scored(super().step(action, timeout_s=timeout_s, **kwargs))

    async def step_async(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        return self._scored(await super().step_async(action, timeout_s=timeout_s, **kwargs))

    def _step_impl(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        return Observation(metadata={"error": f"{type(action).__name__} is not a tool call"})

    @property
    def state(self) -> ArithmeticState:
        return self._state


class GuessAction(Action):
    """Guess the hidden number."""

    number: int = Field(ge=1, le=8, description="the number guessed, from 1 to 8.")


class GuessObservation(Observation):
    feedback: str = ""


class GuessState(State):
    target: int = 0
    guesses: list[int] = Field(default_factory=list)
    max_guesses: int = 3


class GuessEnvironment(Environment):
    """A number from 1 to 8 to find in `max_guesses` guesses."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = GuessState()

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, target: Optional[int] = None,
              max_guesses: int = 3, **kwargs: Any) -> GuessObservation:  # fmt: skip
        target = target if target is not None else random.Random(seed).randint(1, 8)
        self._state = GuessState(episode_id=episode_id, target=target, max_guesses=max_guesses)
        return GuessObservation(feedback=f"Find my number from 1 to 8 in {max_guesses} guesses.")

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
        state = self._state
        state.step_count += 1
        state.guesses.append(action.number)
        found = action.number == state.target
        feedback = "correct" if found else ("higher" if action.number < state.target else "lower")
        done = found or len(state.guesses) >= state.max_guesses
        return GuessObservation(feedback=feedback, reward=1.0 if found else -0.1, done=done)

    @property
    def state(self) -> GuessState:
        return self._state

"""Agent inputs that failed unclearly (issue 36): `tools=multiply` (not a list), an environment whose
`get_reward` is not callable, and a finite but absurd turn reward from a tool (refused as scores beyond ±1e10 are,
naming the tool)."""

import re

import pytest
from test_agent_tools import Shop, multiply

from trl_ppo.agents.execution import ToolCall, execute_calls
from trl_ppo.agents.tools import make_tool, toolbox


def test_a_single_function_as_tools_says_to_pass_a_list():
    with pytest.raises(TypeError, match=r"^`tools` must be a list of functions, got 'multiply': pass `tools=\[multi"):
        toolbox(multiply)
    with pytest.raises(TypeError, match=r"^`tools` must be a list of functions, got a dict: pass a list\."):
        toolbox({"multiply": multiply})
    assert list(toolbox([multiply])) == ["multiply"]


def test_an_environment_whose_get_reward_is_not_callable_is_named():
    class Broken(Shop):
        get_reward = 3.0

    with pytest.raises(TypeError, match=r"`environment_factory` \(Broken\): its `get_reward` is 3\.0, not a method"):
        toolbox([], Broken())


@pytest.mark.parametrize("reward", [1e30, -2e10])
def test_an_absurd_turn_reward_names_the_tool(reward):
    def score() -> tuple:
        """Return a turn reward."""
        return "ok", reward

    shown = re.escape(f"{reward:g}")
    with pytest.raises(ValueError, match=rf"^Tool 'score' returned the turn reward {shown}, beyond ±1e\+10"):
        execute_calls([[ToolCall("score", {})]], [{"score": make_tool(score, "`tools`")}])

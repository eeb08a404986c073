"""Agents' pieces without a model (issue 25): tool schemas, environments, tool execution (semantic 4: failures
are answers), and the tokenizer's side (semantic 1: tool answers appended as the chat template's ids, checked
templates)."""

import asyncio

import pytest
from conftest import needs_tool_parsing
from transformers.utils import get_json_schema

from trl_ppo.agents.chat import ToolChat, check_parsing_api
from trl_ppo.agents.environments import Environments, environment_reward
from trl_ppo.agents.execution import ToolCall, ToolResult, execute_calls
from trl_ppo.agents.tiny_chat import CHAT_TEMPLATE, build_tool_tokenizer
from trl_ppo.agents.tools import make_tool, schemas, toolbox


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


async def slow_add(a: int, b: int) -> int:
    """Add two integers, slowly.

    Args:
        a: the first term.
        b: the second term.
    """
    await asyncio.sleep(0)
    return a + b


def explode(reason: str) -> str:
    """Always fails.

    Args:
        reason: why.
    """
    raise RuntimeError(reason)


class Shop:
    def reset(self, **row):
        self.row, self.bought = row, []
        return f"You have {row['money']} coins."

    def buy(self, item: str) -> tuple:
        """Buy an item.

        Args:
            item: what to buy.
        """
        self.bought.append(item)
        return f"bought {item}", 0.5  # a turn reward

    def get_reward(self) -> float:
        return float(len(self.bought))

    def _secret(self) -> None:
        pass


@pytest.fixture(scope="module")
def tool_tokenizer():
    return build_tool_tokenizer()


# ------------------------------------------------------------------------------------------------ tools
def test_tool_schemas_are_transformers_own_for_sync_and_async_functions():
    assert make_tool(multiply, "`tools`").schema == get_json_schema(multiply)
    tool = make_tool(slow_add, "`tools`")
    assert tool.name == "slow_add" and tool.is_async and tool.schema == get_json_schema(slow_add)


def test_a_tool_that_cannot_be_described_is_refused_naming_it():
    def undocumented(a: int) -> int:
        return a

    with pytest.raises(ValueError, match=r"`tools`: cannot describe the tool `undocumented`.*docstring.*Args:"):
        toolbox([undocumented])
    with pytest.raises(ValueError, match="two tools are named `multiply`"):
        toolbox([multiply, multiply])


def test_an_environments_public_methods_are_tools_bound_to_it():
    shop = Shop()
    shop.reset(money=3)
    tools = toolbox([multiply], shop)
    assert sorted(tools) == ["buy", "multiply"]  # not reset, get_reward or private methods
    tools["buy"].function(item="apple")
    assert shop.bought == ["apple"]
    assert [s["function"]["name"] for s in schemas(tools)] == ["multiply", "buy"]


# ----------------------------------------------------------------------------------------- environments
def test_one_environment_per_episode_reset_with_its_row():
    environments = Environments(Shop, columns=["prompt", "money"])
    first, added = environments.create({"prompt": "p", "money": 3})
    second, _ = environments.create({"prompt": "q", "money": 5})
    assert first is not second and added == "You have 3 coins." and second.row["money"] == 5
    assert environment_reward(first) == 0.0 and environment_reward(object()) == 0.0


def test_environments_routed_by_the_environment_column():
    class Bank(Shop):
        def reset(self, **row):
            self.bought = []

    environments = Environments({"shop": Shop, "bank": Bank}, columns=["prompt", "environment", "money"])
    assert isinstance(environments.create({"environment": "bank"})[0], Bank)
    assert environments.create({"environment": "bank"})[1] is None
    with pytest.raises(ValueError, match="`environment` is 'zoo', which `environment_factory` does not name"):
        environments.create({"environment": "zoo"})
    with pytest.raises(ValueError, match="needs an `environment` column.*columns are \\['prompt'\\]"):
        Environments({"shop": Shop}, columns=["prompt"])
    with pytest.raises(TypeError, match="`environment_factory` must be a class"):
        Environments(3)


def test_a_non_finite_environment_reward_is_an_error():
    class Broken(Shop):
        def get_reward(self):
            return float("nan")

    with pytest.raises(ValueError, match=r"`Broken.get_reward\(\)` returned nan"):
        environment_reward(Broken())


# -------------------------------------------------------------------------------------------- execution
def test_failures_are_answers_not_crashes():
    shop = Shop()
    shop.reset(money=1)
    tools = toolbox([multiply, explode], shop)
    calls = [
        [ToolCall("multiply", {"a": 6, "b": 7}), ToolCall("divide", {"a": 1})],
        [ToolCall("multiply", {"a": 6}), ToolCall("multiply", [6, 7]), ToolCall("explode", {"reason": "boom"})],
        [ToolCall("buy", {"item": "pear"})],
    ]
    results = execute_calls(calls, [tools] * 3)
    assert results[0][0] == ToolResult("multiply", "42")
    assert results[0][1].error and "no tool named 'divide'" in results[0][1].content
    assert results[1][0].error and "bad arguments for multiply" in results[1][0].content
    assert results[1][1].error and "must be a JSON object" in results[1][1].content
    assert results[1][2] == ToolResult("explode", "Error: explode raised RuntimeError: boom", error=True)
    assert results[2][0] == ToolResult("buy", "bought pear", reward=0.5) and shop.bought == ["pear"]


def test_only_text_and_a_number_is_a_turn_reward():
    def returns(value):
        def tool() -> object:
            """Return a fixed value."""
            return value

        return {"tool": make_tool(tool, "`tools`")}

    answers = [(48.85, 2.35), (7, 3), ("yes", True), ("done", 2)]
    results = execute_calls([[ToolCall("tool", {})]] * 4, [returns(value) for value in answers])
    assert [r[0] for r in results[:3]] == [
        ToolResult("tool", "[48.85, 2.35]"), ToolResult("tool", "[7, 3]"), ToolResult("tool", '["yes", true]')
    ]
    assert results[3][0] == ToolResult("tool", "done", reward=2.0)
    with pytest.raises(ValueError, match=r"Tool 'tool' returned the turn reward nan: a turn reward must be finite"):
        execute_calls([[ToolCall("tool", {})]], [returns(("oops", float("nan")))])


def test_async_tools_of_one_batch_run_concurrently():
    """Each call waits until all of them have started: run one after another, each would time out."""
    started, count = [], 3

    async def meet(name: str) -> str:
        """Wait for the others.

        Args:
            name: who.
        """
        started.append(name)
        for _ in range(200):
            if len(started) == count:
                return f"{name} met"
            await asyncio.sleep(0.01)
        raise TimeoutError("alone")

    tools = toolbox([meet])
    calls = [[ToolCall("meet", {"name": "a"})], [ToolCall("meet", {"name": "b"}), ToolCall("meet", {"name": "c"})]]
    results = execute_calls(calls, [tools, tools])
    assert [[r.content for r in episode] for episode in results] == [["a met"], ["b met", "c met"]]


# ------------------------------------------------------------------------------------------------- chat
@needs_tool_parsing
def test_tool_calls_are_parsed_with_the_tokenizers_response_template(tool_tokenizer):
    chat = ToolChat(tool_tokenizer, schemas(toolbox([multiply])), tool_tokenizer.eos_token_id)
    prompt = _ids(tool_tokenizer, [{"role": "user", "content": "6*7?"}], add_generation_prompt=True)
    turn = 'Sure.<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": "7"}}</tool_call><|im_end|>'
    calls, failed = chat.parse_tool_calls(tool_tokenizer.encode(turn, add_special_tokens=False), prompt)
    assert calls == [ToolCall("multiply", {"a": 6, "b": 7})] and not failed  # "7" cast by the tool's schema
    plain = tool_tokenizer.encode("It is 42.<|im_end|>", add_special_tokens=False)
    assert chat.parse_tool_calls(plain, prompt) == ([], False)
    broken = '<tool_call>{"name": "multiply", "argu</tool_call><|im_end|>'
    broken = tool_tokenizer.encode(broken, add_special_tokens=False)
    assert chat.parse_tool_calls(broken, prompt) == ([], True)


@needs_tool_parsing
def test_tool_answers_are_the_chat_templates_ids_after_the_models_own_tokens(tool_tokenizer):
    """Token in, token out: prompt + the model's ids + the answer's ids render the conversation exactly."""
    tokenizer = tool_tokenizer
    tools = schemas(toolbox([multiply]))
    chat = ToolChat(tokenizer, tools, tokenizer.eos_token_id)
    user = {"role": "user", "content": "6*7?"}
    prompt = _ids(tokenizer, [user], tools=tools, add_generation_prompt=True)
    model = tokenizer.encode(
        '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call><|im_end|>', add_special_tokens=False
    )
    answer = chat.answer_ids([ToolResult("multiply", "42"), ToolResult("multiply", "Error: no")])
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}}
    conversation = [
        user,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "multiply", "content": "42"},
        {"role": "tool", "name": "multiply", "content": "Error: no"},
    ]
    expected = _ids(tokenizer, conversation, tools=tools, add_generation_prompt=True)
    assert prompt + model + answer.ids == expected and answer.truncated == 0
    long = chat.answer_ids([ToolResult("multiply", "x" * 50), ToolResult("multiply", "short")], max_tokens=10)
    text = tokenizer.decode(long.ids)
    assert long.truncated == 1 and "x" * 10 + "\n" in text and "x" * 11 not in text


@needs_tool_parsing
def test_a_tokenizer_that_cannot_do_tools_is_refused_saying_what_to_add(tool_tokenizer, tokenizer):
    tools = schemas(toolbox([multiply]))
    with pytest.raises(ValueError, match="does not render messages of role 'tool'|does not show the tools"):
        ToolChat(_with(tokenizer, response_template=tool_tokenizer.response_template), tools, tokenizer.eos_token_id)
    with pytest.raises(ValueError, match="has no `response_template`: set `tokenizer.response_template`"):
        ToolChat(_with(tool_tokenizer, response_template=None), tools, tool_tokenizer.eos_token_id)
    with pytest.raises(ValueError, match="Tools need a stop token.*set `stop_token='eos'`"):
        ToolChat(tool_tokenizer, tools, None)
    no_tool_role = CHAT_TEMPLATE.replace("message.content }}{{ '\\n' }}</tool_response>", "'' }}</tool_response>")
    with pytest.raises(ValueError, match="does not render messages of role 'tool'"):
        ToolChat(_with(tool_tokenizer, chat_template=no_tool_role), tools, tool_tokenizer.eos_token_id)


@needs_tool_parsing
def test_a_chat_template_that_rewrites_earlier_turns_is_refused(tool_tokenizer):
    """Like thinking templates that drop earlier `<think>` blocks: an assistant's text shows only in the last turn."""
    rewriting = CHAT_TEMPLATE.replace("{{ message.content or '' }}", "{{ message.content if loop.last else '' }}")
    tokenizer = _with(tool_tokenizer, chat_template=rewriting)
    with pytest.raises(ValueError, match="is not prefix-preserving: rendering a longer conversation changes"):
        ToolChat(tokenizer, schemas(toolbox([multiply])), tokenizer.eos_token_id)


@needs_tool_parsing
def test_a_chat_template_that_drops_earlier_think_blocks_is_refused(tool_tokenizer):
    """A template that keeps a turn's `<think>` block only while it is the last turn renders plain turns unchanged:
    the check probes turns that think too (issue 34)."""
    content = "{{ message.content or '' }}"
    dropping = CHAT_TEMPLATE.replace(content, f"{{% if loop.last %}}{content}{{% else %}}"
                                              "{{ (message.content or '').split('</think>')[-1] }}{% endif %}")
    tokenizer = _with(tool_tokenizer, chat_template=dropping)
    with pytest.raises(ValueError, match="is not prefix-preserving: rendering a longer conversation changes"):
        ToolChat(tokenizer, schemas(toolbox([multiply])), tokenizer.eos_token_id)


def test_an_old_transformers_parsing_api_is_refused_naming_the_version(tool_tokenizer):
    class OldTokenizer(type(tool_tokenizer)):
        def parse_response(self, response, schema=None):  # transformers 5.3: `response_schema`, no `prefix`
            raise AssertionError("not called")

    old = _with(tool_tokenizer)
    old.__class__ = OldTokenizer
    with pytest.raises(ImportError, match=r"install transformers>=5\.24"):
        check_parsing_api(old)


def _ids(tokenizer, messages, **kwargs) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, **kwargs), add_special_tokens=False)


def _with(tokenizer, **attributes):
    import copy

    changed = copy.deepcopy(tokenizer)
    for name, value in attributes.items():
        setattr(changed, name, value)
    return changed


def test_a_tool_object_with_an_async_call_is_awaited():
    """A tool given as an object with its `tool_schema` and an `async __call__` (a client of a tool server) is
    awaited on the run's loop: called as a sync tool, it answered the model "<coroutine object ...>"."""

    class Lookup:
        tool_schema = {"type": "function", "function": {"name": "lookup", "description": "Look up a word.",
                                                        "parameters": {"type": "object", "required": ["word"],
                                                                       "properties": {"word": {"type": "string"}}}}}

        async def __call__(self, word: str) -> str:
            await asyncio.sleep(0)
            return word.upper()

    tools = toolbox([Lookup()])
    assert tools["lookup"].is_async
    results = execute_calls([[ToolCall("lookup", {"word": "apple"})]], [tools])
    assert results == [[ToolResult("lookup", "APPLE")]]

"""The turn loop (issue 25) with a scripted model: token in, token out (semantic 1), the masks and the budget
(semantic 2), per-turn rewards (semantic 3), failures as answers (semantic 4)."""

import pytest
import torch
from conftest import needs_tool_parsing

from trl_ppo import ppo
from trl_ppo.agents.chat import ToolChat
from trl_ppo.agents.execution import ToolResult
from trl_ppo.agents.tiny_chat import build_tool_tokenizer
from trl_ppo.agents.tools import schemas, toolbox
from trl_ppo.rollout.turn_loop import Episode, episodes_rollout, run_turns

pytestmark = needs_tool_parsing


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


def pay(amount: int) -> tuple:
    """Pay.

    Args:
        amount: how much.
    """
    return "paid", 0.25 * amount


TOOLS = toolbox([multiply, pay])


@pytest.fixture(scope="module")
def tok():
    return build_tool_tokenizer()


@pytest.fixture(scope="module")
def chat(tok):
    return ToolChat(tok, schemas(TOOLS), tok.eos_token_id)


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def call(name: str, arguments: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call><|im_end|>'


class Script:
    """A model that writes the given turns, in order, for each episode (by its index in the first call)."""

    def __init__(self, turns_per_episode: list[list[list[int]]]) -> None:
        self.turns, self.calls, self.contexts = turns_per_episode, [], {}

    def __call__(self, contexts, max_new_tokens):
        self.calls.append((len(contexts), max_new_tokens))
        written = []
        for context in contexts:
            episode = self.contexts.setdefault(tuple(context[:4]), len(self.contexts))
            written.append(self.turns[episode].pop(0)[:max_new_tokens])
        return written


def episode(tok, marker: str) -> Episode:
    prompt = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True)
    return Episode(ids(tok, f"{marker}|" + prompt), TOOLS)


def test_a_tool_answer_is_appended_as_ids_after_the_models_own_tokens(tok, chat):
    # The model writes the bytes of "<|im_start|>" one by one: decoding and encoding again would merge them into the
    # special token. They must stay as written.
    first = ids(tok, "Hm <") + ids(tok, "|im_start|>") + ids(tok, call("multiply", '{"a": 6, "b": 7}'))
    second = ids(tok, "42<|im_end|>")
    played = run_turns([episode(tok, "e0")], Script([[first, second]]), chat, max_turns=4, budget=400)[0]
    answer = chat.answer_ids([ToolResult("multiply", "42")]).ids
    assert played.response == first + answer + second
    assert played.model_mask == [True] * len(first) + [False] * len(answer) + [True] * len(second)
    assert played.turns == 2 and played.tool_calls == 1 and played.tool_errors == 0 and not played.truncated
    assert "<tool_response>\n42\n</tool_response>" in tok.decode(answer)


def test_episodes_end_on_their_own_turn_and_share_each_sampling_call(tok, chat):
    script = Script(
        [
            [ids(tok, "done<|im_end|>")],  # no tool call: ends after one turn
            [ids(tok, call("pay", '{"amount": 2}')), ids(tok, call("pay", '{"amount": 4}')), ids(tok, "ok<|im_end|>")],
        ]
    )
    first, second = run_turns([episode(tok, "e0"), episode(tok, "e1")], script, chat, max_turns=5, budget=500)
    assert [count for count, _ in script.calls] == [2, 1, 1]  # both sampled together, then only the second
    assert first.turns == 1 and second.turns == 3
    assert second.turn_rewards == [0.5, 1.0, 0.0]  # each tool's reward is its turn's
    rollout = episodes_rollout([first, second], tok.pad_token_id, 500, "cpu")
    assert rollout.responses.shape == (2, 500) and rollout.turn_rewards.tolist() == [[0, 0, 0], [0.5, 1.0, 0]]
    placed = ppo.per_turn_token_rewards(rollout.turn_rewards, rollout.response_mask)
    turn_ends = ppo.turn_ends(rollout.response_mask)[1].nonzero().flatten().tolist()
    assert placed[1, turn_ends].tolist() == [0.5, 1.0, 0.0] and placed.sum() == 1.5
    assert rollout.attended_responses.sum(1).tolist() == [len(first.response), len(second.response)]
    assert rollout.response_mask.sum(1).tolist() == [sum(first.model_mask), sum(second.model_mask)]
    assert (rollout.response_mask <= rollout.attended_responses).all()


def test_failed_calls_are_answered_and_counted(tok, chat):
    turns = [ids(tok, call("divide", "{}")), ids(tok, call("multiply", '{"a": 1}')), ids(tok, '<tool_call>{"na')]
    script = Script([turns + [ids(tok, "</tool_call><|im_end|>"), ids(tok, "sorry<|im_end|>")]])
    played = run_turns([episode(tok, "e0")], script, chat, max_turns=5, budget=600)[0]
    # The third turn has no stop token (as when the budget cuts it): the episode ends there, counted as truncated.
    assert played.tool_calls == 2 and played.tool_errors == 2 and played.turns == 3 and played.truncated
    text = tok.decode(played.response)
    assert "no tool named 'divide'" in text and "bad arguments for multiply" in text


def test_unreadable_tool_call_markup_is_answered_as_an_error(tok, chat):
    unreadable = ids(tok, '<tool_call>{"name": "multiply", "argu</tool_call><|im_end|>')
    script = Script([[unreadable, ids(tok, "x<|im_end|>")]])
    played = run_turns([episode(tok, "e0")], script, chat, max_turns=3, budget=600)[0]
    assert played.tool_calls == 1 and played.tool_errors == 1 and played.turns == 2 and not played.truncated


def test_the_budget_covers_model_and_tool_tokens(tok, chat):
    first = ids(tok, call("multiply", '{"a": 6, "b": 7}'))
    answer = chat.answer_ids([ToolResult("multiply", "42")]).ids
    # Room for the first turn and the answer, then the second turn is cut by the budget (it never stops).
    budget = len(first) + len(answer) + 3
    script = Script([[first, ids(tok, "4242424242<|im_end|>")]])
    played = run_turns([episode(tok, "e0")], script, chat, max_turns=4, budget=budget)[0]
    assert len(played.response) == budget and played.truncated and played.turns == 2
    assert script.calls[-1][1] == 3  # the sampler was asked for no more than the room left
    # An answer that would leave no room for the model ends the episode instead of being appended.
    budget = len(first) + len(answer)
    played = run_turns([episode(tok, "e0")], Script([[first]]), chat, max_turns=4, budget=budget)[0]
    assert played.response == first and played.truncated and played.tool_calls == 1


def test_long_tool_answers_are_cut_and_max_turns_ends_an_episode(tok, chat):
    script = Script([[ids(tok, call("multiply", '{"a": 123456789, "b": 987654321}'))] * 2])
    played = run_turns([episode(tok, "e0")], script, chat, max_turns=2, budget=800, max_tool_response_length=4)[0]
    assert played.truncated_answers == 1 and "\n1219\n</tool_response>" in tok.decode(played.response)
    assert played.turns == 2 and played.tool_calls == 1 and played.truncated  # the last turn's call: unanswered


def test_without_tools_an_episode_is_one_response(tok):
    script = Script([[ids(tok, "a<|im_end|>")]])
    played = run_turns([episode(tok, "e0")], script, None, max_turns=1, budget=10)[0]
    assert played.turns == 1 and not played.truncated and played.model_mask == [True] * 2
    rollout = episodes_rollout([played], tok.pad_token_id, 10, "cpu")
    assert torch.equal(rollout.response_mask, rollout.attended_responses)

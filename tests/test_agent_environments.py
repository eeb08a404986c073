"""Environments written for TRL GRPO, run by `PPOTrainer` with only the import changed (issue 34, part 1): the shape
of TRL 1.12's example environments (a game with `reset(**kwargs) -> str`, tool methods, a private static helper,
a reward function reading `environments`), one keeping async state across turns, one that is the only reward and
has no tools; `close()`; stop-token metrics of the last turn; what `truncated_episodes` does to the update."""

import asyncio
import random

import pytest
import torch
from conftest import needs_tool_parsing
from datasets import Dataset
from test_agent_training import agent_trainer, shop_dataset, tool_policy

from trl_ppo import PPOTrainer
from trl_ppo.agents import runner as agent_runner_module
from trl_ppo.agents.tiny_chat import build_tool_tokenizer
from trl_ppo.config_checks import validate_config

pytestmark = needs_tool_parsing


# ---------------------------------------------- environments as a TRL GRPO user writes them (only the import differs)
class LineGameEnv:
    """A one-row sliding game in the shape of TRL's 2048 example: tiles slide and merge, the score grows."""

    def reset(self, **kwargs) -> str:
        self.row, self.score, self.done = [2, 2, 0, 4], 0, False
        return f"score={self.score} row={self.row}"

    def slide(self, direction: str) -> str:
        """Slide the tiles.

        Args:
            direction: "left" or "right".
        """
        if self.done:
            raise ValueError("Game over.")
        tiles = self.row if direction == "left" else self.row[::-1]
        merged, gained = self._merge(tiles)
        self.row = merged if direction == "left" else merged[::-1]
        self.score += gained
        self.done = 0 not in self.row
        return f"score={self.score} row={self.row} done={self.done}"

    @staticmethod
    def _merge(tiles: list[int]) -> tuple[list[int], int]:
        values, merged, gained = [t for t in tiles if t], [], 0
        while values:
            if len(values) > 1 and values[0] == values[1]:
                merged.append(2 * values[0])
                gained += 2 * values[0]
                values = values[2:]
            else:
                merged.append(values.pop(0))
        return merged + [0] * (len(tiles) - len(merged)), gained

    @staticmethod
    def rules() -> str:
        """The rules (a static method: not a tool, as in TRL)."""
        return "merge equal tiles"


def reward_score(environments, **kwargs):
    return [float(env.score) for env in environments]


class AsyncCounterEnv:
    """Async state made on the loop of its first call, as an environment holding an HTTP session or a subprocess
    does: a lock and a pending future created by the first call and awaited by the next."""

    closed = []

    async def reset(self, **kwargs) -> str:
        self.lock, self.pending, self.total = None, None, 0
        return "Count with the tool."

    async def add(self, amount: int) -> str:
        """Add to the counter.

        Args:
            amount: how much.
        """
        if self.lock is None:
            self.lock = asyncio.Lock()
        async with self.lock:
            if self.pending is None:
                self.pending = asyncio.get_running_loop().create_future()
                self.total = amount
                return "started"
            asyncio.get_running_loop().call_later(0.001, self.pending.set_result, amount)
            self.total += await self.pending  # a future of the first call's loop
            return f"total={self.total}"

    async def get_reward(self) -> float:
        return float(self.total)

    async def close(self) -> None:
        AsyncCounterEnv.closed.append(self)


def scripted(tokenizer, calls):
    """A model whose k-th turn is `calls[k]` (a tool call), then an answer."""

    def make(models, sampling):
        def sample_turn(contexts, max_new_tokens):
            turns = []
            for context in contexts:
                answered = tokenizer.decode(context).count("</tool_response>")
                text = calls[answered] if answered < len(calls) else "Done.<|im_end|>"
                turns.append(tokenizer.encode(text, add_special_tokens=False)[:max_new_tokens])
            return turns

        return sample_turn

    return make


def call(name, arguments):
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call><|im_end|>'


def grpo_trainer(make_config, tokenizer, reward, factory, **overrides):
    values = dict(max_turns=3, response_length=280, total_episodes=4, stop_token="eos", num_ppo_epochs=1)
    values |= dict(per_device_train_batch_size=2, gradient_accumulation_steps=1, local_rollout_forward_batch_size=2)
    return PPOTrainer(
        args=make_config(**{**values, **overrides}), processing_class=tokenizer, model=tool_policy(tokenizer),
        ref_model=None, reward_model=reward, train_dataset=shop_dataset(), value_model=None,
        environment_factory=factory,
    )


@pytest.fixture(scope="module")
def tok():
    return build_tool_tokenizer()


def test_trls_game_example_environment_runs_unchanged(make_config, tok, monkeypatch):
    monkeypatch.setattr(agent_runner_module, "turn_sampler", scripted(tok, [call("slide", '{"direction": "left"}')]))
    monkeypatch.setattr(agent_runner_module.AgentRunner, "_lockstep", True)  # the script is the lockstep loop's sampler
    random.seed(0)
    trainer = grpo_trainer(make_config, tok, reward_score, LineGameEnv)  # a reward requiring `environments`
    assert [tool["function"]["name"] for tool in trainer.agents.chat.tools] == ["slide"]  # no static method
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "env/turns_mean" in entry]
    assert len(logs) == 2 and all(entry["env/tool_errors"] == 0 for entry in logs)
    assert all(entry["objective/scores/reward_score"] == 4.0 for entry in logs)  # [2, 2, 0, 4] -> [4, 4, 0, 0]


def test_an_environment_keeping_async_state_across_turns(make_config, tok, monkeypatch):
    calls = [call("add", '{"amount": 2}'), call("add", '{"amount": 5}')]
    monkeypatch.setattr(agent_runner_module, "turn_sampler", scripted(tok, calls))
    monkeypatch.setattr(agent_runner_module.AgentRunner, "_lockstep", True)  # the script is the lockstep loop's sampler
    AsyncCounterEnv.closed.clear()
    trainer = grpo_trainer(make_config, tok, [], lambda: AsyncCounterEnv())  # `get_reward` the only reward
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "env/turns_mean" in entry]
    assert len(logs) == 2 and all(entry["env/tool_errors"] == 0 for entry in logs), logs
    assert all(entry["objective/scores/environment"] == 7.0 for entry in logs)
    episodes = trainer.agents.episodes
    assert len(AsyncCounterEnv.closed) == 1 + 4 and all(e.environment in AsyncCounterEnv.closed for e in episodes)
    assert len({id(environment) for environment in AsyncCounterEnv.closed}) == 5  # the probe, then each episode once


def test_an_environment_without_tools_is_the_only_reward(make_config, tok, monkeypatch):
    class QuizEnv:
        def reset(self, **kwargs) -> str:
            return "Reply in one word."

        def get_reward(self) -> float:
            return 1.0

    tokenizer = build_tool_tokenizer()
    tokenizer.response_template = None  # nothing to parse
    seen = []

    def make(models, sampling):
        def sample_turn(contexts, max_new_tokens):
            seen.extend(tokenizer.decode(context) for context in contexts)
            return [tokenizer.encode("Yes.<|im_end|>", add_special_tokens=False)] * len(contexts)

        return sample_turn

    monkeypatch.setattr(agent_runner_module, "turn_sampler", make)
    monkeypatch.setattr(agent_runner_module.AgentRunner, "_lockstep", True)  # the script is the lockstep loop's sampler
    trainer = grpo_trainer(make_config, tokenizer, [], QuizEnv, max_turns=1)
    trainer.train()
    assert [e["objective/scores/environment"] for e in trainer.state.log_history if "env/turns_mean" in e] == [1, 1]
    assert "Reply in one word.<|im_end|>\n<|im_start|>assistant\n" in seen[0]  # in the user's message
    with pytest.raises(ValueError, match="`reward_model` is an empty list and no environment.*defines `get_reward`"):
        grpo_trainer(make_config, tokenizer, [], type("Plain", (), {"reset": lambda self, **kwargs: None}),
                     max_turns=1)


def test_a_reward_requiring_environments_is_passed_them(make_config, tok):
    def strict(completions, environments):
        return [float(env.score) for env in environments]

    trainer = grpo_trainer(make_config, tok, strict, LineGameEnv)  # accepted: the trainer passes `environments`
    assert [reward.name for reward in trainer.rewards] == ["strict"]
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]] * 8})
    for reward in (strict, reward_score):  # without an environment there are none to pass
        with pytest.raises(ValueError, match="requires 'environments'.*passed with an `environment_factory`"):
            PPOTrainer(args=make_config(), processing_class=tok, model=tool_policy(tok), ref_model=None,
                       reward_model=reward, train_dataset=dataset, value_model=None)


# ---------------------------------------------------------------------------- truncated episodes, stop tokens
def cut_short(tok):
    """A model that calls the tool, then writes on without ever stopping (its last turn is cut)."""
    return scripted(tok, [call("multiply", '{"a": 6, "b": 7}'), "It is 42 and more"])


def says_42(prompts, completions, environments=None, **columns):
    return [1.0 if "42" in completion else 0.0 for completion in completions]


def test_stop_token_metrics_read_the_last_turn(make_config, tok, monkeypatch):
    monkeypatch.setattr(agent_runner_module, "turn_sampler", cut_short(tok))
    monkeypatch.setattr(agent_runner_module.AgentRunner, "_lockstep", True)  # the script is the lockstep loop's sampler
    trainer = agent_trainer(make_config, tok, says_42, missing_eos_penalty=1.0, per_device_eval_batch_size=2)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "env/turns_mean" in entry]
    assert all(entry["val/missing_stop_token_frac"] == 1.0 and entry["env/truncated_frac"] == 1.0 for entry in logs)
    metrics = trainer.evaluate(eval_dataset=trainer.train_dataset.remove_columns("input_ids"))
    assert metrics["eval_val/stop_token_frac"] == 0.0


@pytest.mark.parametrize("mode", ["terminal", "mask", "bootstrap"])
def test_truncated_episodes_are_terminal_masked_or_bootstrapped(make_config, tok, monkeypatch, mode):
    monkeypatch.setattr(agent_runner_module, "turn_sampler", cut_short(tok))
    monkeypatch.setattr(agent_runner_module.AgentRunner, "_lockstep", True)  # the script is the lockstep loop's sampler

    def train(truncated_episodes):
        torch.manual_seed(0)
        trainer = agent_trainer(make_config, tok, says_42, truncated_episodes=truncated_episodes, seed=0)
        before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        trainer.train()
        return before, {name: p.detach().clone() for name, p in trainer.model.named_parameters()}

    before, after = train(mode)
    changed = [name for name, value in after.items() if not torch.equal(value, before[name])]
    if mode == "mask":  # every episode is truncated: nothing is trained on
        assert changed == []
        return
    assert changed
    if mode == "bootstrap":  # the values after the first update are not 0: the second update's targets differ
        _, terminal = train("terminal")
        assert any(not torch.equal(after[name], terminal[name]) for name in after)


def test_truncated_episodes_and_tool_timeout_are_checked(make_config):
    with pytest.raises(ValueError, match="Unknown `truncated_episodes` 'drop': use 'terminal', 'bootstrap' or"):
        validate_config(make_config(truncated_episodes="drop"))
    with pytest.raises(ValueError, match=r"`tool_timeout` must be a finite number of seconds > 0 \(or None"):
        validate_config(make_config(tool_timeout=0))

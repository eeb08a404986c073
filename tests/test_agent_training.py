"""`PPOTrainer(..., tools=, environment_factory=)` (issue 25): checked at construction, the turn loop inside
`train()`, and `max_turns=1` without tools unchanged."""

import json
import math

import pytest
import torch
from conftest import build_trainer, needs_tool_parsing, tiny_config
from datasets import Dataset
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from trl_ppo import PPOTrainer
from trl_ppo import metrics as metrics_module
from trl_ppo import trainer as trainer_module
from trl_ppo.agents import runner as agent_runner_module
from trl_ppo.agents.chat import has_parsing_api
from trl_ppo.agents.runner import AgentRunner
from trl_ppo.agents.tiny_chat import build_tool_tokenizer


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


class Shop:
    def reset(self, **row):
        self.coins, self.bought = row["coins"], []
        return f"You have {self.coins} coins."

    def buy(self, item: str) -> str:
        """Buy an item for one coin.

        Args:
            item: what to buy.
        """
        self.bought.append(item)
        self.coins -= 1
        return f"bought {item}"

    def get_reward(self) -> float:
        return 0.5 * len(self.bought)


@pytest.fixture(scope="module")
def tool_tokenizer():
    return build_tool_tokenizer()


def tool_policy(tokenizer):
    config = tiny_config("qwen2", tokenizer)
    config.max_position_embeddings = 2048  # byte-level prompts that list the tools are long
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def shop_dataset():
    return Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"What is {i} * 7?"}] for i in range(8)], "coins": list(range(8))}
    )


def agent_trainer(make_config, tokenizer, reward, policy=None, **overrides):
    values = dict(max_turns=3, response_length=280, total_episodes=4, stop_token="eos", num_ppo_epochs=1)
    values |= dict(per_device_train_batch_size=2, gradient_accumulation_steps=1, local_rollout_forward_batch_size=2)
    return PPOTrainer(
        args=make_config(**{**values, **overrides}),
        processing_class=tokenizer,
        model=tool_policy(tokenizer) if policy is None else policy,
        ref_model=None,
        reward_model=[reward],
        train_dataset=shop_dataset(),
        value_model=None,
        tools=[multiply],
        environment_factory=Shop,
    )


def scripted_sampler(tokenizer):
    """A model that calls `multiply`, buys an apple, then answers (its log-probs are the real policy's)."""

    def make(models, sampling):
        def sample_turn(contexts, max_new_tokens):
            turns = []
            for context in contexts:
                answers = tokenizer.decode(context).count("</tool_response>")
                calls = [
                    '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call><|im_end|>',
                    '<tool_call>{"name": "buy", "arguments": {"item": "apple"}}</tool_call><|im_end|>',
                    "It is 42.<|im_end|>",
                ]
                turns.append(tokenizer.encode(calls[min(answers, 2)], add_special_tokens=False)[:max_new_tokens])
            return turns

        return sample_turn

    return make


@needs_tool_parsing
def test_train_plays_multi_turn_episodes_with_tools_and_environments(make_config, tool_tokenizer, monkeypatch):
    seen = []

    def says_42(prompts, completions, environments, **columns):
        seen.append((prompts, completions, environments))
        return [1.0 if "42." in completion else 0.0 for completion in completions]

    def critic_metrics(*args):  # the critic's explained variance is asked per turn, up to max_turns
        per_turn.append(args[-1])
        return metrics_module.critic_metrics(*args)

    per_turn = []
    monkeypatch.setattr(agent_runner_module, "turn_sampler", scripted_sampler(tool_tokenizer))
    monkeypatch.setattr(agent_runner_module.AgentRunner, "_lockstep", True)  # the script is the lockstep loop's sampler
    monkeypatch.setattr(trainer_module, "critic_metrics", critic_metrics)
    trainer = agent_trainer(make_config, tool_tokenizer, says_42)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "env/turns_mean" in entry]
    assert len(logs) == 2 and per_turn == [3, 3]
    for entry in logs:
        assert entry["env/turns_mean"] == 3 and entry["env/tool_calls_mean"] == 2
        assert entry["env/tool_errors"] == 0 and entry["env/truncated_frac"] == 0
        assert 0 < entry["val/env_token_frac"] < 1
        assert entry["objective/scores/says_42"] == 1.0 and entry["objective/scores/environment"] == 0.5
        assert math.isclose(entry["objective/scores"], 1.5, abs_tol=1e-6)
        assert all(math.isfinite(v) for v in entry.values() if isinstance(v, float))
        assert entry["val/explained_variance"] <= 1
    prompts, completions, environments = seen[0]
    assert [environment.bought for environment in environments] == [["apple"]] * 2
    assert "You have" in prompts[0] and '"name": "multiply"' in prompts[0]  # reset's text, and the tools shown
    assert "<tool_response>" not in completions[0]  # completions are the model's own tokens
    assert any(not torch.equal(p, before[name]) for name, p in trainer.model.named_parameters())


@pytest.mark.parametrize(
    "overrides, tools, message",
    [
        ({"max_turns": 1}, True, "`max_turns` is 1: the model's tool calls would never be answered"),
        ({"max_turns": 3}, False, "`max_turns` is 3 but there are no `tools` and no `environment_factory`"),
        ({"max_turns": 0}, False, "`max_turns` must be at least 1, got 0"),
        ({"max_turns": 2, "max_tool_response_length": 0}, True, "`max_tool_response_length` must be at least 1"),
    ],
)
def test_agent_settings_are_checked_at_construction(make_config, tokenizer, load_models, overrides, tools, message):
    with pytest.raises(ValueError, match=message):
        build_trainer(make_config(**overrides), tokenizer, load_models, tools=[multiply] if tools else None)


@needs_tool_parsing
def test_a_tokenizer_without_a_tool_template_is_refused_at_construction(make_config, tokenizer, load_models):
    with pytest.raises(ValueError, match="Tools need a stop token"):
        build_trainer(make_config(max_turns=2), tokenizer, load_models, tools=[multiply])
    with pytest.raises(ValueError, match="Tools need a chat template that renders tool calls and tool answers"):
        build_trainer(make_config(max_turns=2, stop_token="eos"), tokenizer, load_models, tools=[multiply])


@pytest.mark.skipif(has_parsing_api(PreTrainedTokenizerBase), reason="this transformers has the parsing API")
def test_tools_on_a_transformers_without_the_parsing_api_are_refused_naming_the_version(make_config, load_models):
    with pytest.raises(ImportError, match=r"install transformers>=5\.24"):
        build_trainer(make_config(max_turns=2), build_tool_tokenizer(), load_models, tools=[multiply])


def test_one_turn_through_the_turn_loop_is_bit_identical_to_single_turn_sampling(
    make_config, tokenizer, load_models, prompt_dataset
):
    """`max_turns=1` without tools is the single-turn path; run through the lockstep turn loop instead, it makes
    the same updates, bit for bit: the loop adds nothing to the rollout of one turn. (The continuous engine draws
    each episode's tokens from a generator of its own: other tokens, the same distribution.)"""

    def run(through_turn_loop: bool):
        trainer = build_trainer(make_config(agent_rollout="lockstep"), tokenizer, load_models, prompt_dataset,
                                value_model=None)
        if through_turn_loop:
            trainer.agents = AgentRunner(trainer.args, tokenizer, None, None, trainer.stop_token_id, None)
        trainer.train()
        weights = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        return weights, [{k: v for k, v in e.items() if not timing(k)} for e in trainer.state.log_history]

    def timing(key: str) -> bool:
        return key == "eps" or "runtime" in key or "per_second" in key

    plain_weights, plain_logs = run(False)
    loop_weights, loop_logs = run(True)
    agent_metrics = {"env/turns_mean": 1, "env/tool_calls_mean": 0, "env/turn_rewards_mean": 0, "env/tool_errors": 0,
                     "env/truncated_frac": 0}
    agent_metrics |= {"env/truncated_tool_responses": 0, "val/env_token_frac": 0, "env/tool_timeouts": 0}
    logged = [entry for entry in loop_logs if "objective/kl" in entry]
    assert len(logged) == 2 and all(entry.items() >= agent_metrics.items() for entry in logged)
    assert plain_logs == [{k: v for k, v in e.items() if k not in agent_metrics} for e in loop_logs]
    for name, value in plain_weights.items():
        assert torch.equal(loop_weights[name], value), name


def random_sampler(tokenizer):
    """A model whose turns are drawn with the global RNG: a `multiply` call with random factors, or an answer (so
    a resumed run must restore the RNG to write the same episodes)."""

    def make(models, sampling):
        def sample_turn(contexts, max_new_tokens):
            turns = []
            for context in contexts:
                a, b, answer = torch.randint(0, 50, (3,)).tolist()
                if answer % 2 or "</tool_response>" in tokenizer.decode(context):
                    text = f"It is {a}.<|im_end|>"
                else:
                    arguments = json.dumps({"a": a, "b": b})
                    text = f'<tool_call>{{"name": "multiply", "arguments": {arguments}}}</tool_call><|im_end|>'
                turns.append(tokenizer.encode(text, add_special_tokens=False)[:max_new_tokens])
            return turns

        return sample_turn

    return make


@needs_tool_parsing
def test_a_multi_turn_run_resumes_bit_identical(make_config, tool_tokenizer, monkeypatch, tmp_path):
    """4 updates straight vs. stopped after update 2 and resumed: the same weights and logs, bit for bit."""
    monkeypatch.setattr(agent_runner_module, "turn_sampler", random_sampler(tool_tokenizer))
    monkeypatch.setattr(agent_runner_module.AgentRunner, "_lockstep", True)  # the script is the lockstep loop's sampler

    def reward(prompts, completions, environments=None, **columns):
        return [float(len(completion) % 5) for completion in completions]

    settings = dict(total_episodes=8, save_strategy="steps", save_steps=2, logging_steps=1, response_length=160)

    def trainer(output_dir):
        return agent_trainer(make_config, tool_tokenizer, reward, output_dir=str(tmp_path / output_dir), **settings)

    straight = trainer("a")
    straight.train()
    first = trainer("b")
    first.args.num_total_batches = 2  # stopped after update 2, with checkpoint-2 written
    first.train()
    resumed = trainer("b")
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4
    calls = [entry["env/tool_calls_mean"] for entry in straight.state.log_history if "env/tool_calls_mean" in entry]
    assert len(calls) == 4 and 0 < sum(calls)  # some episodes did call the tool
    for name, value in straight.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value), name
    logs = [[{k: v for k, v in e.items() if k != "eps"} for e in t.state.log_history] for t in (straight, resumed)]
    assert logs[0] == logs[1]


@needs_tool_parsing
def test_evaluation_and_the_completions_table_play_whole_episodes(make_config, tool_tokenizer, monkeypatch):
    def says_42(prompts, completions, environments=None, **columns):
        return [1.0 if "42." in completion else 0.0 for completion in completions]

    monkeypatch.setattr(agent_runner_module, "turn_sampler", scripted_sampler(tool_tokenizer))
    monkeypatch.setattr(agent_runner_module.AgentRunner, "_lockstep", True)  # the script is the lockstep loop's sampler
    trainer = agent_trainer(make_config, tool_tokenizer, says_42, per_device_eval_batch_size=2)
    rows = trainer.generate_completions()
    assert len(rows) == 2 and rows[0]["score"] == 1.5  # says_42, and the environment's reward for one apple
    response = rows[0]["model response"]
    assert response.startswith('<tool_call>{"name": "multiply"') and response.endswith("It is 42.")
    assert response.count("[tool]") == 2 and "[tool]\nuser\n<tool_response>\n42\n</tool_response>" in response
    metrics = trainer.evaluate(eval_dataset=shop_dataset())
    assert metrics["eval_objective/scores"] == 1.5 and metrics["eval_objective/scores/environment"] == 0.5


@needs_tool_parsing
def test_prompts_grown_by_their_tools_are_fitted_to_max_prompt_length_and_the_context(make_config, tool_tokenizer):
    """The dataset's prompts fit; rendered with the tools' schemas and `reset`'s text they are ~500 tokens."""

    def nothing(completions):
        return [0.0] * len(completions)

    def trainer(**overrides):
        made = agent_trainer(make_config, tool_tokenizer, nothing, response_length=64, total_episodes=2, **overrides)
        made.model.config.max_position_embeddings = 256  # what `context_length` reads
        return made

    with pytest.raises(ValueError, match=r"An episode's prompt has \d{3} tokens once rendered with its tools.*"
                                         r"exceeds the model's context \(256 positions\).*at most 192"):
        trainer().train()
    fitted = trainer(max_prompt_length=192)
    fitted.train()
    assert fitted.state.global_step == 1
    assert max(len(episode.query) for episode in fitted.agents.episodes) == 192

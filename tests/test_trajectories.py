"""`trajectory_dir` (issue 35): each update's episodes written as JSON lines during a run, read back, and their
advantages and losses recomputed without sampling; nothing done when it is off."""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from conftest import needs_tool_parsing
from test_agent_training import agent_trainer, scripted_sampler

from trl_ppo import ppo, trajectories
from trl_ppo.agents import runner as agent_runner_module
from trl_ppo.agents.tiny_chat import build_tool_tokenizer
from trl_ppo.cli import main
from trl_ppo.rollout import Rollout


@pytest.fixture(scope="module")
def tool_tokenizer():
    return build_tool_tokenizer()


def says_42(prompts, completions, **columns):
    return [1.0 if "42." in completion else 0.0 for completion in completions]


@pytest.fixture
def written(make_config, tool_tokenizer, monkeypatch, tmp_path):
    """The trajectory file of a 2-update run of 3-turn episodes with turn-level GAE."""
    monkeypatch.setattr(agent_runner_module, "turn_sampler", scripted_sampler(tool_tokenizer))
    monkeypatch.setattr(agent_runner_module.AgentRunner, "_lockstep", True)  # the script is the lockstep loop's sampler
    folder = tmp_path / "trajectories"
    trainer = agent_trainer(make_config, tool_tokenizer, says_42, trajectory_dir=str(folder), gae_level="turn")
    trainer.train()
    return trajectories.trajectory_file(str(folder), 0)


@pytest.mark.slow
@needs_tool_parsing
def test_a_run_writes_its_episodes_and_their_advantages_recompute_exactly(written, capsys):
    updates = trajectories.read_updates(written)
    assert sorted(updates) == [1, 2] and all(len(records) == 2 for records in updates.values())
    record = updates[1][0]
    assert len(record["turn_starts"]) == 3 and record["turn_rewards"] == [0.0, 0.0, 0.0]
    assert record["score"] == pytest.approx(1.5)  # says_42 and the environment's 0.5
    assert [segment["role"] for segment in record["segments"]] == ["model", "tool", "model", "tool", "model"]
    assert "multiply" in record["segments"][0]["text"] and "42" in record["segments"][1]["text"]
    assert "".join(record["tokens"]) == "".join(segment["text"] for segment in record["segments"])  # one per token
    assert len(record["tokens"]) == len(record["response_ids"]) and "multiply" in record["prompt"]
    assert (record["tool_calls"], record["tool_errors"]) == (2, 0)
    assert record["settings"]["gae_level"] == "turn"
    for records in updates.values():
        again = trajectories.recompute(records)
        assert torch.equal(again.advantages.advantages, again.logged_advantages)
        assert torch.equal(again.advantages.returns, again.logged_returns)
        assert torch.isfinite(again.policy_loss) and again.value_loss > 0
        first = again.mask[0].nonzero().flatten()[0]
        assert again.logged_advantages[0, first] == again.logged_advantages[0, first + 1]  # one per turn
    # The recomputation reads the settings: token-level GAE gives other advantages for the same episodes.
    token_level = [record | {"settings": record["settings"] | {"gae_level": "token"}} for record in updates[1]]
    assert not torch.equal(trajectories.recompute(token_level).advantages.advantages, again.logged_advantages)
    main(["trajectories", written])  # the same, from the command line
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["update", "episodes", "max|dA|"]
    assert [line.split()[:3] for line in lines[1:]] == [["1", "2", "0.0e+00"], ["2", "2", "0.0e+00"]]


def test_records_of_a_rollout_read_back_and_recompute_exactly(tmp_path, capsys):
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 1, 0], [1, 1, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    attended = torch.tensor([[1] * 8 + [0], [1] * 3 + [0] * 6], dtype=torch.bool)
    rollout = Rollout(torch.tensor([[0, 5], [6, 7]]), torch.tensor([[False, True], [True, True]]),
                      torch.randint(1, 50, (2, 9)), mask, logprobs=-torch.rand(2, 9), ref_logprobs=-torch.rand(2, 9),
                      values=torch.randn(2, 9), scores=torch.tensor([1.0, -1.0]), response_attention_mask=attended)
    rewards = ppo.kl_shaped_rewards(rollout.scores, torch.rand(2, 9) * mask, mask, 0.05)
    args = SimpleNamespace(gamma=0.99, lam=0.9, lam_value=1.0, length_adaptive_lam_alpha=None, gae_level="turn",
                           cliprange=0.2, cliprange_value=0.2, loss_agg_mode="token-mean",
                           truncated_episodes="terminal")
    advantages = ppo.advantages_and_returns(rewards.rewards, rollout.values, mask, 0.99, 0.9, 1.0, None, "turn")
    records = trajectories.episode_records(3, 0, rollout, rewards, advantages, args)
    assert [len(r["response_ids"]) for r in records] == [8, 3] and records[0]["turn_starts"] == [0, 4, 7]
    trajectories.write_update(str(tmp_path), 0, records)
    updates = trajectories.read_updates(trajectories.trajectory_file(str(tmp_path), 0))
    again = trajectories.recompute(updates[3])
    assert torch.equal(again.advantages.advantages, advantages.advantages)
    assert torch.equal(again.advantages.returns, advantages.returns)
    expected_pg = -ppo.masked_mean(advantages.advantages, mask)  # ratio 1: the clipped loss is -A
    torch.testing.assert_close(again.policy_loss, expected_pg)
    # A truncated episode bootstrapped from V: the logged rewards are before the bootstrap term, added again here.
    cut = dataclasses.replace(rollout, truncated=torch.tensor([True, False]))
    bootstrapped = ppo.bootstrap_truncated_rewards(rewards.rewards, cut.values, mask, cut.truncated, 0.99)
    advantages = ppo.advantages_and_returns(bootstrapped, cut.values, mask, 0.99, 0.9, 1.0, None, "turn")
    args.truncated_episodes = "bootstrap"
    records = trajectories.episode_records(4, 0, cut, rewards, advantages, args)
    assert [r["truncated"] for r in records] == [True, False]
    assert torch.equal(trajectories.recompute(records).advantages.advantages, advantages.advantages)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"update": 1}) + "\n{not json\n")
    with pytest.raises(SystemExit, match="broken.jsonl, line 2: not a JSON trajectory record"):
        main(["trajectories", str(broken)])


def test_each_token_keeps_the_space_before_it():
    """A word-level tokenizer (like SentencePiece) drops a word's leading space when the word is decoded alone: the
    text of each token is read with the tokens before it."""
    from trl_ppo.default_job import build_word_tokenizer

    tokenizer = build_word_tokenizer()
    ids = tokenizer.encode("the weather looked wonderful", add_special_tokens=False)
    assert trajectories.token_texts(ids, tokenizer) == ["the", " weather", " looked", " wonderful"]
    assert trajectories.token_texts(ids, tokenizer, context=0) == ["the", "weather", "looked", "wonderful"]


def test_nothing_is_computed_or_written_when_off(make_config, tokenizer, load_models, monkeypatch, tmp_path):
    from conftest import build_trainer
    from test_large_scale_options import episodes_of_unequal_lengths

    def refuse(*args, **kwargs):
        raise AssertionError("trajectory records made with trajectory_dir=None")

    monkeypatch.setattr(trajectories, "episode_records", refuse)
    trainer = build_trainer(make_config(total_episodes=8), tokenizer, load_models)
    trainer.step(*episodes_of_unequal_lengths(tokenizer))
    assert not list(tmp_path.rglob("trajectories-*.jsonl"))

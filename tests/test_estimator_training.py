"""`advantage_estimator` and `num_generations` in the trainer: refused settings before any compute, whole groups on
every process, critic-free runs that build no value function, and the default unchanged."""

import math

import pytest
import torch
from conftest import build_trainer, needs_tool_parsing

from trl_ppo import PPOConfig, PPOTrainer, trajectories
from trl_ppo.config_checks import validate_config
from trl_ppo.data import SharedOrderBatchSampler
from trl_ppo.value_head import AutoModelForCausalLMWithValueHead, is_value_head_model

CRITIC_FREE = dict(advantage_estimator="grpo", num_generations=4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(advantage_estimator="ppo"), r"Unknown `advantage_estimator` 'ppo': use one of 'gae', 'grpo'"),
        (dict(scale_rewards="batch"), r"Unknown `scale_rewards` 'batch'"),
        (dict(advantage_estimator="rloo", num_generations=4, scale_rewards="none"), r"an option of `advantage_esti"),
        (dict(num_generations=0), r"`num_generations` must be at least 1"),
        (dict(num_generations=3), r"\(8\) is not a multiple of it"),
        (dict(advantage_estimator="grpo"), r"needs `num_generations` >= 2 \(with 1, every advantage would be 0\)"),
        (dict(CRITIC_FREE, num_critic_epochs=2), r"`num_critic_epochs=2` is an option of the critic"),
        (dict(CRITIC_FREE, critic_warmup_steps=1), r"`critic_warmup_steps=1` is an option of the critic"),
        (dict(CRITIC_FREE, whiten_rewards=True), r"`whiten_rewards=True` is an option of the critic"),
        (dict(CRITIC_FREE, lam_value=1.0), r"`lam_value=1.0` is an option of the critic"),
        (dict(CRITIC_FREE, save_value_model=True), r"`save_value_model=True` is an option of the critic"),
        (dict(CRITIC_FREE, truncated_episodes="bootstrap"), r"bootstraps from the critic's value"),
        (dict(CRITIC_FREE, gamma=0.99), r"`gamma` must be 1.0, got 0.99"),
    ],
)
def test_bad_estimator_settings_are_refused_before_any_compute(tmp_path, overrides, message):
    config = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                       **overrides)  # fmt: skip
    with pytest.raises(ValueError, match=message):
        validate_config(config)


def test_a_value_model_or_value_head_with_a_critic_free_estimator_is_refused(make_config, tokenizer, load_models):
    config = make_config(**CRITIC_FREE)
    with pytest.raises(ValueError, match=r"'grpo'` is critic-free .* but a `value_model` was given: pass "
                                         r"`value_model=None`"):
        build_trainer(config, tokenizer, load_models)
    policy, _, reward_model = load_models()
    with pytest.raises(ValueError, match=r"but `model` has a value head: pass `model.pretrained_model`"):
        PPOTrainer(args=config, processing_class=tokenizer, model=AutoModelForCausalLMWithValueHead(policy),
                   ref_model=None, reward_model=reward_model)  # fmt: skip


def test_the_sampler_gives_each_process_whole_groups_of_distinct_prompts():
    batches = [list(SharedOrderBatchSampler(12, 4, 2, rank, seed=5, repeats=2)) for rank in (0, 1)]
    assert [len(b) for b in batches] == [3, 3]  # 12 prompts, 2 per process and batch: 3 batches an epoch
    seen = []
    for batch in batches[0] + batches[1]:
        assert batch[0] == batch[1] and batch[2] == batch[3] and batch[0] != batch[2]
        seen += batch[::2]
    assert sorted(seen) == list(range(12))  # every prompt once per epoch, on one process
    plain = list(SharedOrderBatchSampler(12, 4, 2, 1, seed=5))  # repeats=1: the order as before groups existed
    order = torch.randperm(12, generator=torch.Generator().manual_seed(5)).tolist()
    assert plain == [order[4:8]]


def half_flat(seen):
    """Each call's (update's) first group of 4 scored alike, its second 0, 1, 2, 3: one group of two without
    signal, `objective/frac_reward_zero_std` 1/2 exactly."""

    def reward(prompts, completions, **columns):
        seen.append(prompts)
        return [1.0] * 4 + [0.0, 1.0, 2.0, 3.0]

    return reward


def grouped_prompts(seen):
    def reward(prompts, completions, **columns):
        seen.append(prompts)
        return [float(completion.count("good")) - 0.1 * len(completion.split()) for completion in completions]

    return reward


@pytest.mark.parametrize(
    "estimator", ["grpo", pytest.param("rloo", marks=pytest.mark.slow), pytest.param("reinforce_baseline",
                                                                                   marks=pytest.mark.slow)]
)  # the quick loop trains one; the math of each is in test_estimators
def test_a_critic_free_run_builds_no_value_function_and_logs_no_value_metrics(
    estimator, make_config, tokenizer, load_models, prompt_dataset
):
    seen = []
    config = make_config(advantage_estimator=estimator, num_generations=4, stop_token="eos")
    trainer = build_trainer(config, tokenizer, load_models, prompt_dataset, reward=half_flat(seen), value_model=None)
    wrapper = trainer.accelerator.unwrap_model(trainer.model)
    assert wrapper.value_model is None and not is_value_head_model(wrapper.policy)
    assert not any("v_head" in name or name.startswith("value_model") for name, _ in wrapper.named_parameters())
    before = {name: p.detach().clone() for name, p in wrapper.named_parameters()}
    trainer.train()
    assert len(seen) == 2 and all(p[0] == p[1] == p[2] == p[3] and p[4] == p[7] for p in seen)  # whole groups
    logs = [entry for entry in trainer.state.log_history if "objective/scores" in entry]
    assert len(logs) == 2
    for entry in logs:
        assert not any(key.startswith(("loss/value", "val/clipfrac", "val/vpred")) for key in entry)
        assert entry["objective/frac_reward_zero_std"] == 0.5 and "loss/policy_avg" in entry  # 1 flat group of 2
    assert trainer.state.epoch == pytest.approx(16 / (64 * 4))  # 4 prompts of 64 per update, 2 updates
    assert any(not torch.equal(p, before[name]) for name, p in wrapper.named_parameters())


def test_num_generations_with_gae_keeps_its_critic(make_config, tokenizer, load_models, prompt_dataset):
    seen = []
    config = make_config(num_generations=2, total_episodes=8)
    trainer = build_trainer(config, tokenizer, load_models, prompt_dataset, reward=grouped_prompts(seen))
    trainer.train()
    assert seen[0][0::2] == seen[0][1::2]  # pairs
    assert "loss/value_avg" in trainer.state.log_history[0] and "objective/frac_reward_zero_std" in \
        trainer.state.log_history[0]  # fmt: skip


@needs_tool_parsing
def test_multi_turn_grpo_credits_each_episode_once_on_its_model_tokens(make_config, monkeypatch, tmp_path):
    """GRPO as published (KL only as a loss): one advantage per episode, on its model turns and not its tool answers;
    the trajectory file recomputes it exactly."""
    from test_agent_training import agent_trainer, random_sampler

    from trl_ppo.agents import runner as agent_runner_module
    from trl_ppo.agents.tiny_chat import build_tool_tokenizer

    tokenizer = build_tool_tokenizer()
    monkeypatch.setattr(agent_runner_module, "turn_sampler", random_sampler(tokenizer))
    monkeypatch.setattr(agent_runner_module.AgentRunner, "_lockstep", True)  # the script is the lockstep loop's sampler
    torch.manual_seed(1)

    def reward(prompts, completions, **columns):
        return [float(len(completion) % 5) for completion in completions]

    folder = tmp_path / "trajectories"
    trainer = agent_trainer(make_config, tokenizer, reward, advantage_estimator="grpo", num_generations=2,
                            kl_coef=0.0, kl_loss_coef=0.01, trajectory_dir=str(folder), response_length=160)
    trainer.train()
    updates = trajectories.read_updates(trajectories.trajectory_file(str(folder), 0))
    tools, signals = 0, 0
    for records in updates.values():
        again = trajectories.recompute(records)
        assert torch.equal(again.advantages.advantages, again.logged_advantages)
        assert again.value_loss is None and records[0]["values"] is None
        records = sorted(records, key=lambda record: record["episode"])
        for pair in zip(records[::2], records[1::2]):  # the groups of 2, in order
            (r1, r2) = [record["score"] for record in pair]
            assert all(record["shaped_score"] == record["score"] and not any(record["turn_rewards"]) for record in pair)
            # GRPO by hand on a pair: mean (r1 + r2) / 2, Bessel's std |r1 - r2| / sqrt(2), so
            # A1 = ((r1 - r2) / 2) / (|r1 - r2| / sqrt(2) + 1e-4) = -A2 (about +-0.707); 0 for a flat pair
            first = 0.0 if r1 == r2 else (r1 - r2) / 2 / (abs(r1 - r2) / math.sqrt(2) + 1e-4)
            signals += r1 != r2
            for record, expected in zip(pair, (first, -first)):
                flags, advantages = record["model_mask"], record["advantages"]
                tools += flags.count(0)
                assert all(a == 0 for a, f in zip(advantages, flags) if not f)
                model_turns = [a for a, f in zip(advantages, flags) if f]  # one number over all its model turns
                assert model_turns == pytest.approx([expected] * len(model_turns), rel=1e-5, abs=1e-7)
    assert tools > 0 and signals > 0  # some episodes did call the tool; some pairs differed


def test_step_reads_runs_of_num_generations_episodes_as_groups(make_config, tokenizer, load_models):
    """`step()` with GRPO: the advantages of 8 given episodes are those of two groups of 4, in their order."""
    from test_step_api import hand_made_episodes

    config = make_config(total_episodes=80, advantage_estimator="grpo", num_generations=4, kl_coef=0.0)
    trainer = build_trainer(config, tokenizer, load_models, value_model=None)
    queries, responses, _ = hand_made_episodes(tokenizer)
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    update = trainer.update_on_episodes(queries, responses, scores)
    first = update.advantages.advantages[:, 0]
    # By hand: group 1 has mean 1/4 and Bessel's std sqrt((0.75^2 + 3 * 0.25^2) / 3) = sqrt(0.25) = 0.5, so
    # (0.75, -0.25, -0.25, -0.25) / (0.5 + 1e-4); group 2 is flat: exactly 0.
    torch.testing.assert_close(first, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0]) / 0.5001)
    assert torch.equal(first[4:], torch.zeros(4))
    assert update.rollout.values is None and update.advantages.returns is None
    assert update.metrics["objective/frac_reward_zero_std"] == 0.5


def test_a_training_set_must_hold_the_prompts_of_one_batch_not_its_episodes():
    from datasets import Dataset

    from trl_ppo.data import check_one_batch

    check_one_batch(Dataset.from_dict({"prompt": ["a", "b"]}), batch_size=8, samples_per_prompt=4)  # 2 prompts
    with pytest.raises(ValueError, match=r"has 1 prompts, fewer than one batch takes \(2 = `batch_size` 8 = .* / "
                                         r"num_generations \(4\)\)"):
        check_one_batch(Dataset.from_dict({"prompt": ["a"]}), batch_size=8, samples_per_prompt=4)

"""The critic's own optimisation (issue 57): `critic_learning_rate` (its own AdamW groups and schedule), value
pretraining (`critic_warmup_steps` with `critic_warmup_epochs`), and the warning when the critic explains nothing
for many updates (`critic.CriticWatch`); each on hand-worked numbers or one small update."""

import logging
from types import SimpleNamespace

import pytest
import torch
from conftest import build_trainer
from test_large_scale_options import episodes_of_unequal_lengths

from trl_ppo import PPOConfig, PPOTrainer, critic
from trl_ppo.checkpoint.identity import config_changes
from trl_ppo.config_checks import validate_config
from trl_ppo.update import epoch_plan


# ------------------------------------------------------------------------------------------- the groups
def test_each_group_is_split_into_its_policy_and_its_critic_parameters():
    a, b, c, d, e = (torch.nn.Parameter(torch.zeros(1)) for _ in range(5))
    groups = [{"params": [a, b, c], "weight_decay": 0.1, "lr": 1e-3},
              {"params": [d, e], "weight_decay": 0.0, "lr": 1e-3}]
    split = critic.split_critic_groups(groups, {id(b), id(d), id(e)}, critic_lr=5e-3)
    # decay: policy [a, c], critic [b]; no decay: no policy part (left out), critic [d, e]
    assert [[id(p) for p in g["params"]] for g in split] == [[id(a), id(c)], [id(b)], [id(d), id(e)]]
    assert [(g["lr"], g["weight_decay"], g.get(critic.CRITIC_GROUP, False)) for g in split] == [
        (1e-3, 0.1, False), (5e-3, 0.1, True), (5e-3, 0.0, True)]
    assert groups[0]["params"] == [a, b, c]  # the given groups are not changed


def _groups(trainer):
    """[(the group's parameter names, lr, weight decay, critic)] of the trainer's optimizer."""
    names = {id(p): name for name, p in trainer.model.named_parameters()}
    return [({names[id(p)] for p in group["params"]}, group["lr"], group["weight_decay"],
             group.get(critic.CRITIC_GROUP, False)) for group in trainer.optimizer.param_groups]


@pytest.mark.parametrize("value_model", ["separate", None], ids=["value_model", "value_head"])
def test_the_critic_parameters_get_groups_of_their_own(value_model, make_config, tokenizer, load_models):
    config = make_config(learning_rate=1e-3, critic_learning_rate=4e-3, weight_decay=0.01, warmup_steps=1)
    trainer = build_trainer(config, tokenizer, load_models, value_model=value_model)
    groups = _groups(trainer)
    critic_prefix = "value_model." if value_model else "policy.v_head."
    trainable = {name for name, p in trainer.model.named_parameters() if p.requires_grad}
    grouped = [name for names, *_ in groups for name in names]
    assert sorted(grouped) == sorted(trainable)  # every trainable parameter once, none in two groups
    for names, lr, weight_decay, is_critic in groups:
        assert all(name.startswith(critic_prefix) for name in names) == is_critic
        assert all(name.startswith(critic_prefix) != (not is_critic) for name in names)
        assert lr == 0.0  # the first step of the warm-up: 0 x each group's own rate
        # transformers' split: biases and norms without weight decay, in the critic's groups too
        assert all(("bias" in name or "norm" in name) == (weight_decay == 0.0) for name in names)
    assert [g["initial_lr"] for g in trainer.optimizer.param_groups] == [
        4e-3 if is_critic else 1e-3 for *_, is_critic in groups]
    assert sum(is_critic for *_, is_critic in groups) == 2  # with and without weight decay
    if value_model is None:  # the shared backbone is the policy's
        assert all(not is_critic for names, *_, is_critic in groups if any("pretrained_model" in n for n in names))


@pytest.mark.filterwarnings("ignore:Detected call of")  # no update: the schedule alone
def test_the_schedule_moves_both_rates_by_the_same_factor(make_config, tokenizer, load_models):
    # 4 updates, linear decay after 1 warm-up step: factors 0, 1, 2/3, 1/3
    config = make_config(learning_rate=1e-3, critic_learning_rate=5e-3, warmup_steps=1, total_episodes=32)
    trainer = build_trainer(config, tokenizer, load_models)
    seen = []
    for _ in range(4):
        seen.append(critic.learning_rates(trainer.lr_scheduler))
        trainer.lr_scheduler.step()
    factors = (0.0, 1.0, 2 / 3, 1 / 3)
    for rates, factor in zip(seen, factors):
        assert rates["lr"] == pytest.approx(1e-3 * factor) and rates["lr_critic"] == pytest.approx(5e-3 * factor)


def test_without_a_critic_rate_one_rate_for_all(make_config, tokenizer, load_models):
    trainer = build_trainer(make_config(), tokenizer, load_models)
    assert not any(is_critic for *_, is_critic in _groups(trainer))
    assert critic.learning_rates(trainer.lr_scheduler) == {}  # `lr` stays the first group's, no `lr_critic`


def _one_step(make_config, tokenizer, load_models, **settings):
    config = make_config(per_device_train_batch_size=8, gradient_accumulation_steps=1, total_episodes=8, **settings)
    trainer = build_trainer(config, tokenizer, load_models)
    wrapper = trainer._models().wrapper
    value_before = {n: p.detach().clone() for n, p in wrapper.value_model.named_parameters()}
    stats = trainer.step(*episodes_of_unequal_lengths(tokenizer))
    policy = {n: p.detach().clone() for n, p in wrapper.lm.named_parameters()}
    moved = sum(float((p.detach() - value_before[n]).norm() ** 2) for n, p in wrapper.value_model.named_parameters())
    return policy, moved, stats, trainer


def test_a_higher_critic_rate_moves_the_value_more_and_the_policy_the_same(make_config, tokenizer, load_models):
    """One update of the same episodes, seed and policy rate: the value model moves more at 10x its rate; the
    policy's gradient does not depend on the value weights within the update (its advantages were computed
    before it), so its weights end where they would have."""
    policy_1, moved_1, stats_1, _ = _one_step(make_config, tokenizer, load_models)
    policy_10, moved_10, stats_10, _ = _one_step(make_config, tokenizer, load_models, critic_learning_rate=1e-2)
    assert moved_10 > 3**2 * moved_1  # squared distances
    for name, weights in policy_1.items():
        torch.testing.assert_close(weights, policy_10[name], msg=name)
    assert "lr_critic" not in stats_1 and stats_10["lr_critic"] == pytest.approx(1e-2)
    assert stats_10["lr"] == stats_1["lr"] == pytest.approx(1e-3)


# ------------------------------------------------------------------------------------------- refusals
def test_a_critic_rate_must_be_positive(make_config):
    with pytest.raises(ValueError, match="critic_learning_rate.*>= 0"):
        make_config(critic_learning_rate=-1e-3)
    with pytest.raises(ValueError, match="critic_learning_rate.*> 0"):
        validate_config(make_config(critic_learning_rate=0.0))
    with pytest.raises(ValueError, match="critic_learning_rate \\* weight_decay"):
        make_config(critic_learning_rate=0.5, weight_decay=2.0)
    with pytest.raises(ValueError, match="critic_warmup_epochs.*at least 1"):
        validate_config(make_config(critic_warmup_epochs=0))


@pytest.mark.parametrize("option", [{"critic_learning_rate": 1e-3}, {"critic_warmup_epochs": 4}])
def test_a_critic_free_estimator_refuses_the_critic_options(option, make_config):
    config = make_config(advantage_estimator="grpo", num_generations=2, **option)
    with pytest.raises(ValueError, match=f"`{next(iter(option))}=.*option of the critic.*'grpo'"):
        validate_config(config)


def test_a_given_optimizer_refuses_a_critic_rate(make_config, tokenizer, load_models):
    policy, value_model, reward_model = load_models()
    optimizer = torch.optim.SGD(list(policy.parameters()) + list(value_model.parameters()), lr=1e-3)
    with pytest.raises(ValueError, match="critic_learning_rate.*optimizer was given"):
        PPOTrainer(args=make_config(critic_learning_rate=1e-2), processing_class=tokenizer, model=policy,
                   ref_model=None, reward_model=reward_model, value_model=value_model, optimizers=(optimizer, None))


def test_a_resume_cannot_change_the_critic_rate():
    refused, _ = config_changes({"critic_learning_rate": None}, {"critic_learning_rate": 1e-3})
    assert len(refused) == 1 and "critic_learning_rate" in refused[0]


def test_the_command_line_sets_the_critic_fields():
    from transformers import HfArgumentParser

    (config,) = HfArgumentParser(PPOConfig).parse_args_into_dataclasses(
        ["--output_dir", "out", "--critic_learning_rate", "5e-4", "--critic_warmup_steps", "3",
         "--critic_warmup_epochs", "8", "--num_critic_epochs", "2", "--lam_value", "1.0"])
    assert (config.critic_learning_rate, config.critic_warmup_steps, config.critic_warmup_epochs,
            config.num_critic_epochs, config.lam_value) == (5e-4, 3, 8, 2, 1.0)


# -------------------------------------------------------------------------------------- value pretraining
def test_a_warmup_update_runs_critic_warmup_epochs():
    args = SimpleNamespace(num_ppo_epochs=2, num_critic_epochs=3, critic_warmup_epochs=None)
    normal = ([False] + [True] * 2) * 2
    assert epoch_plan(args) == epoch_plan(args, warmup=True) == normal
    args.critic_warmup_epochs = 5
    assert epoch_plan(args) == normal and epoch_plan(args, warmup=True) == [False] + [True] * 4


def test_value_pretraining_steps_the_critic_alone_once_per_minibatch_of_each_epoch(
    make_config, tokenizer, load_models
):
    config = make_config(critic_warmup_steps=1, critic_warmup_epochs=3, critic_learning_rate=1e-2, num_mini_batches=2,
                         total_episodes=16)
    trainer = build_trainer(config, tokenizer, load_models)
    wrapper = trainer._models().wrapper
    policy_before = {n: p.detach().clone() for n, p in wrapper.lm.named_parameters()}
    value_before = {n: p.detach().clone() for n, p in wrapper.value_model.named_parameters()}
    trainer.step(*episodes_of_unequal_lengths(tokenizer))
    assert all(torch.equal(policy_before[n], p) for n, p in wrapper.lm.named_parameters())
    assert all(not trainer.optimizer.state.get(p) for p in wrapper.lm.parameters())  # no Adam state at all
    steps = {int(trainer.optimizer.state[p]["step"]) for p in wrapper.value_model.parameters()}
    assert steps == {3 * 2}  # 3 epochs x 2 minibatches
    assert any(not torch.equal(value_before[n], p) for n, p in wrapper.value_model.named_parameters())


# ------------------------------------------------------------------------------------------- the watch
def test_the_streak_counts_updates_in_a_row_that_explain_nothing():
    streaks, streak = [], 0
    for ev in (0.0, -0.3, 0.05, None, 0.2, 0.01, float("nan"), 0.04):
        streak = critic.low_ev_streak(streak, ev)
        streaks.append(streak)
    # 0.05 counts (at most the threshold); None and NaN (undefined) leave it; 0.2 resets it
    assert streaks == [1, 2, 3, 3, 0, 1, 1, 2]


def test_the_patience_is_20_updates_or_a_quarter_of_a_shorter_run():
    assert [critic.ev_patience(n) for n in (4, 20, 21, 40, 79, 80, 200, 10_000)] == [5, 5, 6, 10, 20, 20, 20, 20]


def test_the_watch_warns_once_naming_the_options(caplog):
    watch, warnings = critic.CriticWatch(), []
    evs = [0.0] * 4 + [0.3] + [0.01] * 30  # 4 low, then a good one, then 30 low
    for update, ev in enumerate(evs, start=1):
        message = watch.observe({"val/explained_variance": ev, "val/explained_variance/turn_1": -0.02}, update, 200)
        warnings += [(update, message)] if message else []
    assert [update for update, _ in warnings] == [5 + 20]  # 20 in a row after the reset at update 5
    message = warnings[0][1]
    for option in ("critic_learning_rate", "num_critic_epochs", "critic_warmup_steps", "lam_value"):
        assert f"`{option}`" in message
    assert "20 updates in a row (update 25 of 200; the first turn's, -0.02" in message
    assert critic.CriticWatch().observe({}, 30, 30) is None  # no critic: nothing to count
    restored = critic.CriticWatch()
    restored.load_state_dict(watch.state_dict())
    assert restored == watch and restored.warned


@pytest.mark.slow  # ~3 s; the watch itself is tested above on hand-made numbers
def test_a_run_whose_critic_explains_nothing_logs_the_warning(make_config, tokenizer, load_models, caplog):
    """Five updates of a critic that cannot learn (its rate 1e-12) on episodes whose scores vary: it explains
    nothing, and a run of 5 updates warns after 5 (`MIN_EV_PATIENCE`), once."""
    config = make_config(per_device_train_batch_size=4, gradient_accumulation_steps=1, total_episodes=24,
                         critic_learning_rate=1e-12, num_ppo_epochs=1, response_length=4, disable_tqdm=True)
    trainer = build_trainer(config, tokenizer, load_models)
    with caplog.at_level(logging.WARNING, logger="trl_ppo.critic"):
        for _ in range(6):
            trainer.step(*episodes_of_unequal_lengths(tokenizer, count=4))
    warned = [r.getMessage() for r in caplog.records if "The critic has explained" in r.getMessage()]
    assert len(warned) == 1 and "5 updates in a row (update 5 of 6)" in warned[0]
    assert trainer.run.critic_watch.warned and trainer.run.state_dict()["critic_watch"]["streak"] == 6


@pytest.mark.slow  # two full runs: `make test` runs it, the quick loop does not
def test_value_only_epochs_run_the_value_model_alone_and_train_exactly_as_before(
    make_config, tokenizer, load_models, prompt_dataset, monkeypatch
):
    """With a separate value model in one process, a value-only epoch (`num_critic_epochs`, the warm-up's later
    epochs) skips the policy's forward and backward (weighted 0 there): the same weights and logs as the full pass,
    and the policy's forward is called fewer times."""
    from test_resume import logs_without_time, make, weights

    import trl_ppo.update as update

    settings = dict(num_critic_epochs=3, critic_warmup_steps=1, critic_warmup_epochs=3, save_strategy="no",
                    total_episodes=24)  # fmt: skip
    calls = {"full": 0}
    original = update.pass_backward

    def counted(*args, **kwargs):
        calls["full"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(update, "pass_backward", counted)
    fast = make(make_config, tokenizer, load_models, prompt_dataset, **settings)
    fast.train()
    fast_calls, calls["full"] = calls["full"], 0
    monkeypatch.setattr(update, "value_pass_possible", lambda models: False)
    full = make(make_config, tokenizer, load_models, prompt_dataset, **settings)
    full.train()
    assert fast_calls < calls["full"]
    assert logs_without_time(fast) == logs_without_time(full)
    for name, tensor in weights(full).items():
        assert torch.equal(tensor, weights(fast)[name]), name

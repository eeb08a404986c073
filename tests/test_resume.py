"""Never lose a run: bitwise-exact resume, checkpoints that are never half-written, and preemption by SIGTERM."""

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from trl_ppo import PPOTrainer
from trl_ppo.checkpoint import PPO_STATE_NAME, STAGING_PREFIX, CheckpointSaveError

ROOT = Path(__file__).resolve().parent.parent
TIME_KEYS = ("eps",)  # wall-clock dependent, the only logged values allowed to differ


def make(
    make_config,
    tokenizer,
    load_models,
    prompt_dataset,
    callbacks=None,
    arch="llama",
    shared_head=False,
    rewards=None,
    **overrides,
):
    policy, value_model, _ = load_models(arch)
    values = dict(
        total_episodes=6 * 8,
        save_strategy="steps",
        save_steps=2,
        logging_steps=3,
        stop_token="eos",
        num_ppo_epochs=2,
        num_mini_batches=2,
        response_length=8,
    )
    values.update(overrides)

    def reward(prompts, completions, **columns):
        return [float(c.split().count("good")) - 0.1 * len(c.split()) for c in completions]

    return PPOTrainer(
        args=make_config(**values),
        processing_class=tokenizer,
        model=policy,
        ref_model=None,
        reward_model=rewards if rewards is not None else ([reward, length] if shared_head else reward),
        train_dataset=prompt_dataset,
        value_model=None if shared_head or values.get("advantage_estimator", "gae") != "gae" else value_model,
        callbacks=callbacks,
    )


def length(prompts, completions, **columns):
    return [None if len(c.split()) % 3 == 0 else float(len(c.split())) for c in completions]


def weights(trainer):
    wrapper = trainer.accelerator.unwrap_model(trainer.model)
    return {k: v.clone() for k, v in wrapper.state_dict().items()}  # policy (and its value head), value model


def logs_without_time(trainer):
    return [{k: v for k, v in entry.items() if k not in TIME_KEYS} for entry in trainer.state.log_history]


class StepCounter(TrainerCallback, ExportableState):
    """A stateful callback: its count must survive a resume."""

    def __init__(self, count: int = 0):
        self.count = count

    def on_step_end(self, args, state, control, **kwargs):
        self.count += 1

    def state(self) -> dict:
        return {"args": {"count": self.count}, "attributes": {}}


@pytest.mark.parametrize(
    "variant",
    [
        dict(),
        pytest.param(dict(
            shared_head=True,
            kl_target=0.01,
            kl_horizon=100,
            reward_weights=[1.0, 0.1],
            use_score_scaling=True,
            use_score_norm=True,
            score_clip=2.0,
        ), marks=pytest.mark.slow),  # the quick loop resumes the plain run; make test every option set
        pytest.param(dict(
            critic_warmup_steps=1,
            loss_agg_mode="seq-mean-token-sum-norm",
            cliprange_low=0.1,
            cliprange_high=0.3,
            dual_clip=3.0,
            entropy_coef=0.01,
            lam_value=1.0,
            kl_loss_coef=0.05,
            kl_estimator="k2",
        ), marks=pytest.mark.slow),
        dict(advantage_estimator="grpo", num_generations=4),  # critic-free: no value function to restore
        pytest.param(dict(advantage_estimator="rloo", num_generations=2), marks=pytest.mark.slow),
        pytest.param(dict(advantage_estimator="reinforce_baseline", num_generations=4, kl_coef=0.0,
                          kl_loss_coef=0.05), marks=pytest.mark.slow),  # fmt: skip
        pytest.param(dict(num_generations=2), marks=pytest.mark.slow),  # groups with the critic
    ],
    ids=["value_model", "value_head+adaptive_kl+two_rewards+score_scaling", "large_scale_options", "grpo", "rloo",
         "reinforce_baseline", "gae+num_generations"],
)
def test_resume_is_bitwise_identical(variant, make_config, tokenizer, load_models, prompt_dataset, tmp_path):
    """6 updates straight vs. stopped after update 2 and resumed: the same weights and logs, bit for bit. The
    checkpoint falls between two logs (logging_steps=3), so metrics not yet logged must survive it too, and so
    must the state of a stateful callback (and the adaptive KL coefficient and the running score moments)."""
    straight = make(make_config, tokenizer, load_models, prompt_dataset, **variant)
    straight.train()

    output_dir = str(tmp_path / "b")
    first = make(make_config, tokenizer, load_models, prompt_dataset, [StepCounter()], output_dir=output_dir, **variant)
    first.args.num_total_batches = 2  # stop after update 2 as if killed, with checkpoint-2 written
    first.train()
    assert (tmp_path / "b" / "checkpoint-2" / PPO_STATE_NAME).exists()

    resumed = make(
        make_config, tokenizer, load_models, prompt_dataset, [StepCounter()], output_dir=output_dir, **variant
    )
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6 and resumed.state.episode == 48
    counter = next(cb for cb in resumed.callback_handler.callbacks if isinstance(cb, StepCounter))
    assert counter.count == 6  # 2 before the checkpoint (restored), then 4 more
    a, b = weights(straight), weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert logs_without_time(straight) == logs_without_time(resumed)
    assert len([e for e in resumed.state.log_history if "objective/kl" in e]) == 2  # updates 3 and 6
    assert resumed.run.kl_coef == straight.run.kl_coef
    if variant.get("kl_target"):
        assert resumed.run.kl_coef != resumed.args.kl_coef  # it did move, so restoring it was tested
        assert resumed.run.score_moments.state_dict() == straight.run.score_moments.state_dict()
        assert resumed.run.score_moments.count == 48


def test_a_run_resumed_from_its_last_checkpoint_takes_no_more_updates(
    make_config, tokenizer, load_models, prompt_dataset, tmp_path
):
    """A run stopped after its last update's checkpoint (before its evaluation, say) resumes to its end at once:
    `transformers.Trainer` resumed at `max_steps` takes one step more (TRL's GRPOTrainer went 16 -> 17)."""
    output_dir = str(tmp_path / "run")
    first = make(make_config, tokenizer, load_models, prompt_dataset, output_dir=output_dir)
    first.train()
    again = make(make_config, tokenizer, load_models, prompt_dataset, output_dir=output_dir)
    again.train(resume_from_checkpoint=True)
    assert again.state.global_step == 6 and again.state.episode == 48
    checkpoints = sorted(folder.name for folder in Path(output_dir).glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    a, b = weights(first), weights(again)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_with_another_batch_size_or_model_names_the_difference(
    make_config, tokenizer, load_models, prompt_dataset, tmp_path
):
    make(make_config, tokenizer, load_models, prompt_dataset, total_episodes=16).train()
    other_batch = make(
        make_config,
        tokenizer,
        load_models,
        prompt_dataset,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        total_episodes=16,
    )
    with pytest.raises(ValueError, match=r"per_device_train_batch_size`: checkpoint has 4, this run has 2"):
        other_batch.train(resume_from_checkpoint=True)
    other_model = make(make_config, tokenizer, load_models, prompt_dataset, arch="gpt_neox", total_episodes=16)
    with pytest.raises(ValueError, match="policy_fingerprint"):
        other_model.train(resume_from_checkpoint=True)


def test_resume_with_another_advantage_estimator_is_refused(make_config, tokenizer, load_models, prompt_dataset):
    """The checkpoint records the estimator (and the samples per prompt): another one is another algorithm."""
    grpo = dict(advantage_estimator="grpo", num_generations=4, total_episodes=16)
    make(make_config, tokenizer, load_models, prompt_dataset, **grpo).train()
    rloo = make(make_config, tokenizer, load_models, prompt_dataset, **(grpo | dict(advantage_estimator="rloo")))
    with pytest.raises(ValueError, match=r"`advantage_estimator`: 'grpo' in the checkpoint, 'rloo' now \(another "
                                         r"estimator of the advantages, with or without a critic: another algorithm"):
        rloo.train(resume_from_checkpoint=True)
    pairs = make(make_config, tokenizer, load_models, prompt_dataset, **(grpo | dict(num_generations=2)))
    with pytest.raises(ValueError, match=r"`num_generations`: 4 in the checkpoint, 2 now \(other groups of samples"):
        pairs.train(resume_from_checkpoint=True)
    gae = make(make_config, tokenizer, load_models, prompt_dataset, total_episodes=16)
    with pytest.raises(ValueError, match=r"`advantage_estimator`: 'grpo' in the checkpoint, 'gae' now"):
        gae.train(resume_from_checkpoint=True)


def test_a_checkpoint_with_the_value_head_drawn_names_value_head_init_and_resumes_with_it(
    make_config, tokenizer, load_models, prompt_dataset
):
    """Checkpoints written while `value_head_init` defaulted to 'normal' (or before it existed) start from another
    initial policy than today's default: the refusal says which setting to pass, and with it the run resumes."""
    first = make(make_config, tokenizer, load_models, prompt_dataset, shared_head=True, value_head_init="normal",
                 total_episodes=24)
    first.args.num_total_batches = 2  # stopped after update 2, with checkpoint-2 written
    first.train()
    today = make(make_config, tokenizer, load_models, prompt_dataset, shared_head=True, total_episodes=24)
    with pytest.raises(ValueError, match=r"value_head_init`: checkpoint has 'normal', this run has 'zeros'.*pass "
                                         r"`value_head_init='normal'` to resume"):
        today.train(resume_from_checkpoint=True)
    again = make(make_config, tokenizer, load_models, prompt_dataset, shared_head=True, value_head_init="normal",
                 total_episodes=24)
    again.train(resume_from_checkpoint=True)
    assert again.state.global_step == 3


def test_a_checkpoint_from_before_value_head_init_existed_is_named_as_such():
    from trl_ppo.checkpoint.identity import value_head_init_change

    old = {"policy_fingerprint": {"checksum": 1.0}, "config": {"vf_coef": 0.1}}
    now = {"policy_fingerprint": {"checksum": 2.0}, "config": {"vf_coef": 0.1, "value_head_init": "zeros"}}
    (change,) = value_head_init_change(old, now)
    assert "checkpoint has 'normal' (written before the option existed), this run has 'zeros'" in change
    assert value_head_init_change(old, {**now, "policy_fingerprint": {"checksum": 1.0}}) == []  # same policy
    # a separate value model: no head was added, so the option cannot explain another policy (it was another model)
    assert value_head_init_change(old, {**now, "value_model_fingerprint": {"checksum": 5.0}}) == []


def test_resume_lists_every_changed_setting_and_the_value_it_uses(
    make_config, tokenizer, load_models, prompt_dataset, caplog
):
    first = make(make_config, tokenizer, load_models, prompt_dataset, learning_rate=1e-3, kl_coef=0.05)
    first.args.num_total_batches = 2  # stopped after update 2, checkpoint-2 written
    first.train()
    changed = dict(learning_rate=5e-4, kl_coef=0.1, cliprange=0.1, logging_steps=1)
    resumed = make(make_config, tokenizer, load_models, prompt_dataset, rewards=[length], **changed)
    resumed.args.num_total_batches = 3
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=True)
    assert "with changed settings" in caplog.text
    assert (
        "`learning_rate`: 0.001 in the checkpoint, 0.0005 now -> uses 0.001, restored with the optimizer" in caplog.text
    )
    assert "`kl_coef`: 0.05 in the checkpoint, 0.1 now -> uses 0.05, restored with the run state" in caplog.text
    assert "`cliprange`: 0.2 in the checkpoint, 0.1 now -> uses 0.1" in caplog.text
    assert "`logging_steps`: 3 in the checkpoint, 1 now -> uses 1" in caplog.text
    assert "`rewards`: ['reward'] in the checkpoint, ['length'] now -> uses ['length']" in caplog.text
    assert resumed.optimizer.param_groups[0]["initial_lr"] == 1e-3 and resumed.run.kl_coef == 0.05
    for schedule in (dict(lr_scheduler_type="constant"), dict(warmup_steps=2)):
        another = make(make_config, tokenizer, load_models, prompt_dataset, **schedule)
        name = next(iter(schedule))
        with pytest.raises(ValueError, match=rf"`{name}`: .* in the checkpoint, .* now \(the restored schedule"):
            another.train(resume_from_checkpoint=True)


def test_a_new_run_does_not_overwrite_checkpoints(make_config, tokenizer, load_models, prompt_dataset):
    make(make_config, tokenizer, load_models, prompt_dataset, total_episodes=16).train()
    with pytest.raises(ValueError, match="already holds checkpoints"):
        make(make_config, tokenizer, load_models, prompt_dataset, total_episodes=16).train()


def test_a_failed_save_leaves_the_previous_checkpoint_usable(
    make_config, tokenizer, load_models, prompt_dataset, tmp_path, monkeypatch
):
    trainer = make(
        make_config, tokenizer, load_models, prompt_dataset, save_steps=1, total_episodes=3 * 8, save_total_limit=1
    )
    real_save = PPOTrainer._save_optimizer_and_scheduler
    calls = []

    def failing_save(self, output_dir):
        calls.append(output_dir)
        if len(calls) == 2:  # the checkpoint of update 2 dies half-way
            raise OSError("disk full (simulated)")
        return real_save(self, output_dir)

    monkeypatch.setattr(PPOTrainer, "_save_optimizer_and_scheduler", failing_save)
    with pytest.raises(CheckpointSaveError, match=r"Saving checkpoint-2 failed \(process 0: OSError: disk full"):
        trainer.train()
    out = Path(trainer.args.output_dir)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-1"]
    assert not [p for p in out.iterdir() if p.name.startswith(STAGING_PREFIX)]  # the half-written one is removed
    monkeypatch.setattr(PPOTrainer, "_save_optimizer_and_scheduler", real_save)

    resumed = make(
        make_config, tokenizer, load_models, prompt_dataset, save_steps=1, total_episodes=3 * 8, save_total_limit=1
    )
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3
    # save_total_limit=1 keeps only the newest complete checkpoint.
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-3"]


def _run_script(output_dir, *extra, signal_after_update=None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, str(ROOT / "tests" / "scripts" / "preemptible_run.py"), str(output_dir), *extra]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines = []
    for line in process.stdout:
        lines.append(line.strip())
        if signal_after_update is not None and line.strip() == f"UPDATE {signal_after_update}":
            process.send_signal(signal.SIGTERM)
    stderr = process.stderr.read()
    process.wait(timeout=300)
    return process.returncode, lines, stderr


@pytest.mark.slow
def test_sigterm_checkpoints_exits_zero_and_resumes_to_the_same_result(tmp_path):
    code, straight, err = _run_script(tmp_path / "straight")
    assert code == 0, err[-3000:]

    code, first, err = _run_script(tmp_path / "preempted", signal_after_update=4)
    assert code == 0, err[-3000:]
    assert "POLICY" not in " ".join(first), "the run should have stopped early"
    stopped_at = max(int(line.split()[1]) for line in first if line.startswith("UPDATE"))
    assert 4 <= stopped_at < 8
    assert f"checkpoint-{stopped_at}" in err and "Stopped by SIGTERM" in err
    assert json.loads((tmp_path / "preempted" / f"checkpoint-{stopped_at}" / PPO_STATE_NAME).read_text())

    code, resumed, err = _run_script(tmp_path / "preempted", "resume")
    assert code == 0, err[-3000:]
    pick = lambda lines, tag: [line for line in lines if line.startswith(tag)]  # noqa: E731
    for tag in ("POLICY", "VALUE", "SCORES"):
        assert pick(straight, tag) == pick(resumed, tag), tag


@pytest.mark.parametrize("moment", ["during_rollout", "after_update"])
def test_signal_drops_an_unstarted_update_or_finishes_a_done_one(
    moment, make_config, tokenizer, load_models, prompt_dataset, tmp_path
):
    """SIGINT while update 3 is being scored: update 3 is dropped and the checkpoint is that of update 2.
    SIGINT right after update 3: the checkpoint is that of update 3. Either way the resumed run ends where an
    uninterrupted one does."""
    from transformers import TrainerCallback

    straight = make(make_config, tokenizer, load_models, prompt_dataset, save_steps=100)
    straight.train()

    class SignalAfterUpdate3(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if moment == "after_update" and state.global_step == 3:
                os.kill(os.getpid(), signal.SIGINT)

    trainer = make(
        make_config,
        tokenizer,
        load_models,
        prompt_dataset,
        save_steps=100,
        output_dir=str(tmp_path / "run"),
        callbacks=[SignalAfterUpdate3()],
    )
    original_score = trainer.score

    def score(rollout, batch):
        if moment == "during_rollout" and trainer.state.global_step == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return original_score(rollout, batch)

    trainer.score = score
    handler_before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN in a background job
    with pytest.raises(SystemExit) as stopped:
        trainer.train()
    assert stopped.value.code == 0
    expected_step = 2 if moment == "during_rollout" else 3
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == [f"checkpoint-{expected_step}"]
    assert signal.getsignal(signal.SIGINT) is handler_before  # handlers restored

    resumed = make(
        make_config, tokenizer, load_models, prompt_dataset, save_steps=100, output_dir=str(tmp_path / "run")
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / f"checkpoint-{expected_step}"))
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert logs_without_time(straight) == logs_without_time(resumed)


def test_the_run_state_survives_a_json_round_trip_whole():
    """Everything `RunState` holds comes back from its `state_dict` through JSON (as in `trl_ppo_state.json`),
    and the state dict shares nothing with the live object (a resume point taken earlier stays as it was)."""
    from trl_ppo.run_state import RunState

    run = RunState(kl_coef=0.2)
    run.score_moments.update(torch.tensor([1.0, 3.0, 8.0]))
    run.data_position = (2, 5)
    run.metrics_since_log.add({"objective/scores": 1.5, "lr": 1e-3})
    run.policy_loss_sum, run.skipped_updates = -0.25, 1
    saved = json.loads(json.dumps(run.state_dict()))
    run.metrics_since_log.add({"objective/scores": 9.0, "lr": 1e-4})  # after the snapshot: not in it

    restored = RunState(kl_coef=0.05)
    restored.load_state_dict(saved)
    assert restored.kl_coef == 0.2 and restored.data_position == (2, 5)
    assert restored.score_moments.state_dict() == run.score_moments.state_dict()
    assert restored.metrics_since_log.pop() == {"objective/scores": 1.5, "lr": 1e-3}
    assert (restored.policy_loss_sum, restored.skipped_updates) == (-0.25, 1)
    assert set(saved) == {f.name for f in dataclasses.fields(RunState)} - {"last_checkpoint"}


def test_resume_with_other_prompts_lists_them_and_with_fewer_rows_refuses(
    make_config, tokenizer, load_models, prompt_dataset, caplog
):
    """Issue 28, item 13: the checkpoint records the prompts (rows and a hash of their token ids). Fewer rows make
    another shuffled order, refused; as many other prompts continue the order, listed with the other changes."""
    make(make_config, tokenizer, load_models, prompt_dataset, total_episodes=16).train()  # checkpoint-2
    fewer = make(make_config, tokenizer, load_models, prompt_dataset.select(range(48)), total_episodes=16)
    with pytest.raises(ValueError, match=r"`train_dataset`: 64 prompts in the checkpoint, 48 now \(the shuffled"):
        fewer.train(resume_from_checkpoint=True)
    other = prompt_dataset.map(lambda row: {"prompt": row["prompt"] + " good"})
    resumed = make(make_config, tokenizer, load_models, other, total_episodes=16)
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=True)
    assert "`train_dataset`: other prompts than the checkpoint's (64 rows, another token-id hash)" in caplog.text
    same = make(make_config, tokenizer, load_models, prompt_dataset, total_episodes=16)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        same.train(resume_from_checkpoint=True)
    assert "train_dataset" not in caplog.text

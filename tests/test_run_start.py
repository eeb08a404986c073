"""How a run starts in its `output_dir`, and what every process learns when a start or a save fails: a refused
run deletes nothing; a run that goes on after `train()` keeps its run; a resume from an older checkpoint sets the
newer ones aside instead of mixing two branches; a malformed state file is named; the finite-weights check and a
save's failure reach every process (a one-process test with a stand-in for the other processes)."""

import json
import logging
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from conftest import build_trainer
from test_output_dir import episodes, run_ids, snapshot

import trl_ppo.checkpoint as ckpt
from trl_ppo.checkpoint import STAGING_PREFIX, CheckpointOfAnotherRunError, CheckpointSaveError
from trl_ppo.checkpoint.folders import PPO_STATE_NAME, checkpoint_folders, read_json, write_json
from trl_ppo.checkpoint.manifest import MANIFEST_NAME, manifest_of


def step_run(make_config, tokenizer, load_models, updates: int, **overrides):
    """A `step()` run of `updates` updates, a checkpoint after each -> the trainer."""
    trainer = build_trainer(make_config(**overrides), tokenizer, load_models)
    for _ in range(updates):
        trainer.step(*episodes(tokenizer))
        trainer.save_checkpoint()
    return trainer


_RUN = {}


@pytest.fixture
def three_checkpoints(make_config, tokenizer, load_models, tmp_path_factory):
    """A fresh copy of the `output_dir` of a `step()` run with checkpoint-1, -2 and -3 (made once for this
    module), where `make_config()` writes -> (its path, the run id)."""
    if not _RUN:
        output_dir = str(tmp_path_factory.mktemp("three") / "out")
        trainer = step_run(make_config, tokenizer, load_models, 3, output_dir=output_dir)
        _RUN.update(output_dir=output_dir, run_id=trainer.run.run_id)
    output_dir = make_config().output_dir
    shutil.copytree(_RUN["output_dir"], output_dir)
    return output_dir, _RUN["run_id"]


# ------------------------------------------------------------------------- 1. a refused run deletes nothing
def test_a_refused_second_run_leaves_the_first_runs_save_in_progress(
    three_checkpoints, make_config, tokenizer, load_models, tmp_path
):
    output_dir, _ = three_checkpoints
    in_progress = os.path.join(output_dir, f"{STAGING_PREFIX}4")  # the first run is writing checkpoint-4
    os.makedirs(in_progress)
    open(os.path.join(in_progress, "optimizer.pt"), "wb").close()
    second = build_trainer(make_config(), tokenizer, load_models)
    with pytest.raises(ValueError, match="already holds checkpoints"):
        second.step(*episodes(tokenizer))
    elsewhere = str(tmp_path / "b")  # a copy of checkpoint-1 with another run id
    shutil.copytree(os.path.join(output_dir, "checkpoint-1"), os.path.join(elsewhere, "checkpoint-1"))
    state = read_json(os.path.join(elsewhere, "checkpoint-1", PPO_STATE_NAME))
    _rewrite_state(os.path.join(elsewhere, "checkpoint-1"), {**state, "run_id": "another"})
    resumed = build_trainer(make_config(), tokenizer, load_models)
    with pytest.raises(CheckpointOfAnotherRunError):
        resumed.load_checkpoint(os.path.join(elsewhere, "checkpoint-1"))
    assert os.listdir(in_progress) == ["optimizer.pt"]


def test_an_allowed_resume_still_removes_what_an_interrupted_save_left(
    three_checkpoints, make_config, tokenizer, load_models, caplog
):
    left_over = os.path.join(three_checkpoints[0], f"{STAGING_PREFIX}4")
    os.makedirs(left_over)
    with caplog.at_level(logging.WARNING):
        build_trainer(make_config(), tokenizer, load_models).load_checkpoint(True)
    assert not os.path.exists(left_over) and "unfinished checkpoint folder" in caplog.text


# ------------------------------------------------------------------- 2. going on after `train()` keeps the run
@pytest.mark.parametrize("then", ["step", "save_checkpoint"])
def test_step_or_save_checkpoint_after_train_continue_its_run(
    then, make_config, tokenizer, load_models, prompt_dataset
):
    # overwrite_output_dir: a fresh run would delete train()'s checkpoint; going on must not
    config = make_config(total_episodes=8, save_strategy="steps", save_steps=1, overwrite_output_dir=True)
    trainer = build_trainer(config, tokenizer, load_models, prompt_dataset)
    trainer.train()  # one update: checkpoint-1
    output_dir, run_id = trainer.args.output_dir, trainer.run.run_id
    before = snapshot(output_dir)
    if then == "step":
        trainer.step(*episodes(tokenizer))  # update 2, saved by save_steps=1
        assert trainer.state.global_step == 2
        assert {k: v for k, v in snapshot(output_dir).items() if "checkpoint-1" in k} == before
        assert run_ids(output_dir) == {"checkpoint-1": run_id, "checkpoint-2": run_id}
    else:
        path = trainer.save_checkpoint()
        assert os.path.basename(path) == "checkpoint-1" and trainer.state.global_step == 1
        assert run_ids(output_dir) == {"checkpoint-1": run_id}
    assert trainer.run.run_id == run_id


# --------------------------------------------- 3. the final save's finite-weights check runs on every process
def _poison(trainer):
    with torch.no_grad():
        trainer.accelerator.unwrap_model(trainer.model).policy.gpt_neox.embed_in.weight[3, 0] = float("nan")


def test_save_model_refuses_nonfinite_weights_on_a_process_that_does_not_write(
    make_config, tokenizer, load_models, tmp_path, monkeypatch
):
    """A process other than the main one writes nothing (`should_save` is False) but must raise too: it would
    otherwise go on into the value model's consolidation (a collective) and wait forever for the main one."""
    trainer = build_trainer(make_config(save_value_model=True), tokenizer, load_models)
    _poison(trainer)
    monkeypatch.setattr(type(trainer.args), "should_save", property(lambda self: False))
    with pytest.raises(FloatingPointError, match=r"^Not saving the model to .*embed_in.weight` holds NaN"):
        trainer.save_model(str(tmp_path / "model"))
    assert not (tmp_path / "model").exists()


def test_the_finite_weights_check_gathers_every_processs_finding(monkeypatch):
    """The check both saves share: a process whose own weights are finite raises when another's are not."""
    gathered = []

    def gather_object(items):
        gathered.append(items)
        return ["policy.w", *items]  # process 0 found one

    monkeypatch.setattr("accelerate.utils.gather_object", gather_object)
    accelerator = SimpleNamespace(num_processes=2, process_index=1, is_main_process=False)
    finite = [("policy.w", torch.zeros(2))]
    assert ckpt.nonfinite_weight_of_any_process(accelerator, finite) == "policy.w"
    assert gathered == [[None]]


@pytest.mark.filterwarnings("ignore:No dataset is provided")
def test_legacy_save_pretrained_refuses_on_a_process_that_does_not_write(model_paths, tokenizer, tmp_path, monkeypatch):
    from trl_ppo.legacy import AutoModelForCausalLMWithValueHead, PPOConfig
    from trl_ppo.legacy import PPOTrainer as LegacyTrainer

    model = AutoModelForCausalLMWithValueHead.from_pretrained(model_paths["gpt_neox"][0])
    trainer = LegacyTrainer(PPOConfig(batch_size=2, mini_batch_size=2), model, None, tokenizer)
    with torch.no_grad():
        model.v_head.summary.weight[0, 0] = float("inf")
    monkeypatch.setattr(type(trainer.accelerator), "is_main_process", property(lambda self: False))
    with pytest.raises(FloatingPointError, match=r"the weight `v_head.summary.weight` holds NaN or infinity"):
        trainer.save_pretrained(str(tmp_path / "legacy"))


# ------------------------------------------------------ 4. every process learns why a save failed, and its kind
def as_two_processes(monkeypatch, tmp_path, write_of, order, main_only=False) -> dict:
    """`_on_all_or_fail` run as each process of two, one after the other in `order` (the failing one first); a
    stand-in gather gives each process what the others have sent so far (None: nothing failed) -> {index: error}."""
    sent = {}

    def gather_object(items):
        sent[current] = items[0]
        return [sent.get(0), sent.get(1)]

    monkeypatch.setattr("accelerate.utils.gather_object", gather_object)
    errors = {}
    for current in order:
        accelerator = SimpleNamespace(num_processes=2, process_index=current, is_main_process=current == 0)
        with pytest.raises(Exception) as raised:
            staging = str(tmp_path / "staging")
            ckpt._on_all_or_fail(accelerator, write_of(current), staging, str(tmp_path), 3, main_only)
        errors[current] = raised.value
    return errors


def test_a_save_refused_for_another_runs_checkpoints_is_that_error_on_every_process(tmp_path, monkeypatch):
    def publish():
        raise CheckpointOfAnotherRunError("Not writing checkpoint-3: run 1 is not run 2")

    errors = as_two_processes(monkeypatch, tmp_path, lambda index: publish, (0, 1), main_only=True)
    for error in errors.values():
        assert type(error) is CheckpointOfAnotherRunError
        assert "run 1 is not run 2" in str(error) and "Free space" not in str(error)


def test_a_write_error_of_another_process_is_a_save_error_on_every_process(tmp_path, monkeypatch):
    def write_of(index):
        def write():
            if index == 1:
                raise OSError("disk full")

        return write

    errors = as_two_processes(monkeypatch, tmp_path, write_of, (1, 0))
    for error in errors.values():
        assert type(error) is CheckpointSaveError
        assert "process 1: OSError: disk full" in str(error) and "Free space" in str(error)


# -------------------------------------------------- 5. a malformed state file is named; any failure is shared
def _rewrite_state(path, content):
    write_json(os.path.join(path, PPO_STATE_NAME), content)
    write_json(os.path.join(path, MANIFEST_NAME), manifest_of(path))  # as if written so: it verifies


@pytest.mark.parametrize(
    "content, says",
    [
        ([], "does not hold a JSON object"),
        (None, "does not hold a JSON object"),
        ("x", "does not hold a JSON object"),
        ("without identity", r"holds no run identity \(an `identity` object\)"),
    ],
)
def test_a_malformed_state_file_is_a_value_error_naming_it(
    content, says, three_checkpoints, make_config, tokenizer, load_models
):
    path = os.path.join(three_checkpoints[0], "checkpoint-3")
    if content == "without identity":
        content = {k: v for k, v in read_json(os.path.join(path, PPO_STATE_NAME)).items() if k != "identity"}
    _rewrite_state(path, content)
    with pytest.raises(ValueError, match=rf"checkpoint-3/{PPO_STATE_NAME} {says}"):
        build_trainer(make_config(), tokenizer, load_models).load_checkpoint(path)


def test_a_newer_damaged_checkpoint_holding_null_does_not_stop_the_resume(
    three_checkpoints, make_config, tokenizer, load_models
):
    with open(os.path.join(three_checkpoints[0], "checkpoint-3", PPO_STATE_NAME), "w") as handle:
        handle.write("null")  # damaged after its manifest was written: it does not verify
    assert build_trainer(make_config(), tokenizer, load_models).load_checkpoint(True) == 2


def test_any_failure_of_the_main_process_reaches_the_others(tmp_path, monkeypatch):
    broadcast = []

    def broadcast_object_list(items):
        broadcast.append(list(items))
        return items

    monkeypatch.setattr("accelerate.utils.broadcast_object_list", broadcast_object_list)

    def unexpected(*args):
        raise KeyError("something no one expected")

    monkeypatch.setattr(ckpt, "checkpoint_to_resume", unexpected)
    accelerator = SimpleNamespace(num_processes=2, process_index=0, is_main_process=True)
    with pytest.raises(KeyError, match="something no one expected"):
        ckpt.start_checkpoint(str(tmp_path), None, accelerator, {})
    assert len(broadcast) == 1 and isinstance(broadcast[0][-1], KeyError)


# ------------------------------------- 6. a resume from an older checkpoint sets the newer ones aside, keeping them
def test_resuming_from_an_older_checkpoint_sets_the_newer_ones_aside(
    three_checkpoints, make_config, tokenizer, load_models, caplog
):
    output_dir, run_id = three_checkpoints
    newer = {k: v for k, v in snapshot(output_dir).items() if "checkpoint-1" not in k}
    resumed = build_trainer(make_config(save_total_limit=2), tokenizer, load_models)
    with caplog.at_level(logging.WARNING):
        assert resumed.load_checkpoint(os.path.join(output_dir, "checkpoint-1")) == 1
    assert "set aside" in caplog.text and "checkpoint-3" in caplog.text
    aside = sorted(name for name in os.listdir(output_dir) if ".abandoned-" in name)
    assert [name.split(".")[0] for name in aside] == ["checkpoint-2", "checkpoint-3"]
    kept = {}  # every file of the abandoned branch, unchanged under its new folder name
    for name in aside:
        for root, _, files in os.walk(os.path.join(output_dir, name)):
            for file in files:
                original = os.path.join(root, file).replace(name, name.split(".")[0])
                kept[original] = open(os.path.join(root, file), "rb").read()
    assert kept == newer
    resumed.step(*episodes(tokenizer))
    resumed.save_checkpoint()  # checkpoint-2 of this branch; save_total_limit=2 keeps 1 and 2
    assert [os.path.basename(p) for p in checkpoint_folders(output_dir)] == ["checkpoint-1", "checkpoint-2"]
    assert ckpt.checkpoint_to_resume(output_dir, "latest") == os.path.join(output_dir, "checkpoint-2")
    assert read_json(os.path.join(output_dir, "checkpoint-2", "trainer_state.json"))["global_step"] == 2
    assert len([name for name in os.listdir(output_dir) if ".abandoned-" in name]) == 2
    assert json.loads(open(os.path.join(output_dir, aside[-1], PPO_STATE_NAME)).read())["run_id"] == run_id

"""One `output_dir`, one run: no way of writing a checkpoint (`train()`, `step()`, `save_checkpoint()`) replaces or
mixes with another run's checkpoints (issue 28, item 2); a second run into the same folder says what to do
(resume, `overwrite_output_dir`, another folder) and the default `trl-ppo` job gets a new folder each run
(issue 27, item 10)."""

import logging
import os

import pytest
import torch
from conftest import build_trainer
from transformers import TrainerCallback

from trl_ppo.checkpoint import CheckpointOfAnotherRunError
from trl_ppo.checkpoint.folders import PPO_STATE_NAME, checkpoint_folders, read_json
from trl_ppo.checkpoint.manifest import checkpoint_problem


def episodes(tokenizer, count=8):
    queries = [torch.tensor(tokenizer.encode("the movie was")) for _ in range(count)]
    responses = [torch.tensor(tokenizer.encode("good [EOS]")) for _ in range(count)]
    return queries, responses, [1.0] * count


def run_ids(output_dir) -> dict:
    """{checkpoint name: the run id it records}, and every checkpoint still verifies."""
    ids = {}
    for path in checkpoint_folders(str(output_dir)):
        assert checkpoint_problem(path) is None, path
        ids[os.path.basename(path)] = read_json(os.path.join(path, PPO_STATE_NAME)).get("run_id")
    return ids


def snapshot(output_dir) -> dict:
    """Every file of every checkpoint in `output_dir`, as bytes."""
    files = {}
    for root, _, names in os.walk(output_dir):
        for name in names:
            if "checkpoint-" in root:
                files[os.path.join(root, name)] = open(os.path.join(root, name), "rb").read()
    return files


def test_a_step_api_run_after_a_train_run_never_touches_its_checkpoints(
    make_config, tokenizer, load_models, prompt_dataset
):
    config = make_config(total_episodes=8, save_strategy="steps", save_steps=1)  # one update
    trained = build_trainer(config, tokenizer, load_models, prompt_dataset)
    trained.train()
    before = snapshot(trained.args.output_dir)
    assert set(run_ids(trained.args.output_dir)) == {"checkpoint-1"}

    stepped = build_trainer(make_config(save_strategy="no"), tokenizer, load_models)
    with pytest.raises(ValueError, match=r"already holds checkpoints of a finished run .*update 1 of 1"):
        stepped.step(*episodes(tokenizer))
    with pytest.raises(ValueError, match="overwrite_output_dir=True"):
        stepped.save_checkpoint()
    assert stepped.state.global_step == 0
    assert snapshot(trained.args.output_dir) == before


def test_two_step_api_runs_with_different_seeds_keep_their_checkpoints_apart(make_config, tokenizer, load_models):
    first = build_trainer(make_config(seed=1), tokenizer, load_models)
    second = build_trainer(make_config(seed=2), tokenizer, load_models)
    first.step(*episodes(tokenizer))
    second.step(*episodes(tokenizer))  # both began before either saved
    first.save_checkpoint()
    output_dir = first.args.output_dir
    before, ids = snapshot(output_dir), run_ids(output_dir)
    with pytest.raises(CheckpointOfAnotherRunError, match=rf"checkpoint-1 \(run {ids['checkpoint-1']}\)"):
        second.save_checkpoint()
    assert snapshot(output_dir) == before
    assert sorted(os.listdir(output_dir)) == [".trl_ppo_run.lock", "checkpoint-1"]  # no partial folder left

    third = build_trainer(make_config(seed=3), tokenizer, load_models)  # begun after the save: refused at once
    with pytest.raises(ValueError, match="already holds checkpoints"):
        third.step(*episodes(tokenizer))


class RunAnotherTrainingFirst(TrainerCallback):
    """At this run's first update, another run in the same `output_dir` trains to its end (as if started at the
    same moment on another machine)."""

    def __init__(self, other):
        self.other = other

    def on_step_begin(self, args, state, control, **kwargs):
        if self.other is not None:
            self.other.train()
            self.other = None


def test_two_train_runs_started_before_either_saved_keep_the_first_ones_checkpoints(
    make_config, tokenizer, load_models, prompt_dataset
):
    """The same settings, the same models: only the run id tells the two runs apart."""
    config = dict(total_episodes=8, save_strategy="steps", save_steps=1)  # one update each
    first = build_trainer(make_config(**config), tokenizer, load_models, prompt_dataset)
    second = build_trainer(
        make_config(**config), tokenizer, load_models, prompt_dataset, callbacks=[RunAnotherTrainingFirst(first)]
    )
    with pytest.raises(CheckpointOfAnotherRunError, match=r"Not writing .*checkpoint-1: .*holds checkpoints of anoth"):
        second.train()
    ids = run_ids(first.args.output_dir)
    assert set(ids) == {"checkpoint-1"} and set(ids.values()) == {first.run.run_id}
    assert second.run.run_id != first.run.run_id


def test_a_resumed_run_refuses_an_output_dir_holding_another_runs_checkpoints(
    make_config, tokenizer, load_models, prompt_dataset, tmp_path
):
    """Resumed from a checkpoint elsewhere into a folder of another run: refused before any update."""
    config = dict(total_episodes=8, save_strategy="steps", save_steps=1)
    build_trainer(make_config(**config), tokenizer, load_models, prompt_dataset).train()
    elsewhere = make_config(output_dir=str(tmp_path / "b"), **config)
    build_trainer(elsewhere, tokenizer, load_models, prompt_dataset).train()
    resumed = build_trainer(make_config(**config), tokenizer, load_models, prompt_dataset)
    with pytest.raises(CheckpointOfAnotherRunError, match="holds checkpoints of another run"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-1"))
    assert resumed.state.global_step == 0


def test_overwrite_output_dir_starts_afresh_and_resuming_ignores_it(
    make_config, tokenizer, load_models, prompt_dataset, caplog
):
    config = dict(total_episodes=8, save_strategy="steps", save_steps=1)
    first = build_trainer(make_config(**config), tokenizer, load_models, prompt_dataset)
    first.train()
    resumed = build_trainer(make_config(overwrite_output_dir=True, **config), tokenizer, load_models, prompt_dataset)
    resumed.train(resume_from_checkpoint=True)  # resuming deletes nothing
    assert set(run_ids(first.args.output_dir).values()) == {first.run.run_id}
    again = build_trainer(make_config(overwrite_output_dir=True, **config), tokenizer, load_models, prompt_dataset)
    with caplog.at_level(logging.WARNING):
        again.train()
    assert "`overwrite_output_dir=True`: deleted the earlier run's checkpoints" in caplog.text
    assert set(run_ids(first.args.output_dir).values()) == {again.run.run_id} != {first.run.run_id}


def test_a_legacy_script_run_again_into_its_output_dir_is_refused_at_its_first_step(tmp_path, tokenizer):
    """`trl_ppo.legacy`'s `save_checkpoint()` goes through the same rule: the second run of a script stops at its
    first `step()`, before any update, and the first run's checkpoint is untouched."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from trl_ppo.legacy import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

    torch.manual_seed(0)
    gpt2 = GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=32, vocab_size=len(tokenizer))
    GPT2LMHeadModel(gpt2).save_pretrained(tmp_path / "gpt2")

    def script_run():
        config = PPOConfig(batch_size=8, mini_batch_size=4, seed=len(os.listdir(tmp_path)))
        config.output_dir = str(tmp_path / "run")
        model = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path / "gpt2"))
        return PPOTrainer(config, model, None, tokenizer)

    queries, responses, scores = episodes(tokenizer)
    scores = [torch.tensor(score) for score in scores]  # trl 0.11's `step()` takes tensors
    first = script_run()
    first.step(queries, responses, scores)
    first.save_checkpoint()
    before = snapshot(tmp_path / "run")
    again = script_run()
    with pytest.raises(ValueError, match="already holds checkpoints .*`load_checkpoint\\(\\)` for a run driven by"):
        again.step(queries, responses, scores)
    assert again.trainer.state.global_step == 0 and snapshot(tmp_path / "run") == before


# ------------------------------------------------------------------------------------------------ trl-ppo
TINY_DEFAULT_JOB = [  # one small update
    *("--total_episodes", "8", "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1"),
    *("--num_ppo_epochs", "1", "--response_length", "4", "--num_sample_generations", "0", "--logging_steps", "1"),
]


@pytest.mark.slow
def test_the_default_job_twice_writes_two_folders_and_an_explicit_earlier_one_is_refused(
    tmp_path, monkeypatch, capsys
):
    from transformers import AutoModelForCausalLM

    from trl_ppo.cli import main

    monkeypatch.chdir(tmp_path)
    main(TINY_DEFAULT_JOB)
    main(TINY_DEFAULT_JOB)
    runs = sorted(os.listdir(tmp_path / "trl_ppo_default_run"))
    assert len(runs) == 2
    for name in runs:
        assert AutoModelForCausalLM.from_pretrained(tmp_path / "trl_ppo_default_run" / name) is not None
    assert capsys.readouterr().out.count("Saved the trained policy to") == 2

    earlier = str(tmp_path / "trl_ppo_default_run" / runs[0])
    with pytest.raises(SystemExit, match=r"holds an earlier run .*--overwrite_output_dir"):
        main([*TINY_DEFAULT_JOB, "--output-dir", earlier])  # the dashed alias counts as given too
    main([*TINY_DEFAULT_JOB, "--output_dir", earlier, "--overwrite_output_dir"])
    with pytest.raises(SystemExit, match=rf"no complete checkpoint in `output_dir` \(.*{runs[-1]}\)"):
        main([*TINY_DEFAULT_JOB, "--resume_from_checkpoint", "latest"])  # resumes the newest folder: none saved

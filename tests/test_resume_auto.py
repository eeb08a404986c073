"""`resume_from_checkpoint="auto"` (issue 46, part 3): a job a cluster requeues with the same command resumes from
its newest checkpoint, or starts when it was killed before the first one; what `latest` refuses stays refused."""

import logging
import os

import pytest
import torch
from conftest import build_trainer
from test_resume import logs_without_time, make, weights
from test_run_start import three_checkpoints  # noqa: F401 (a fixture)

from trl_ppo import PPOConfig
from trl_ppo.checkpoint import STAGING_PREFIX
from trl_ppo.checkpoint.folders import checkpoint_folders
from trl_ppo.cli import build_parser, check_resume_flag
from trl_ppo.output_dirs import check_output_dir


def test_auto_starts_a_run_killed_before_its_first_checkpoint_then_resumes_it_bit_identically(
    make_config, tokenizer, load_models, prompt_dataset, tmp_path, caplog
):
    straight = make(make_config, tokenizer, load_models, prompt_dataset)
    straight.train()

    output_dir = tmp_path / "requeued"
    left_over = output_dir / f"{STAGING_PREFIX}2-killed"  # a kill during the first save leaves this
    left_over.mkdir(parents=True)
    (left_over / "optimizer.pt").write_bytes(b"half")
    first = make(make_config, tokenizer, load_models, prompt_dataset, output_dir=str(output_dir))
    first.args.num_total_batches = 2  # killed after update 2, with checkpoint-2 written
    with caplog.at_level(logging.WARNING):
        first.train(resume_from_checkpoint="auto")
    assert f"`resume_from_checkpoint='auto'`: no checkpoint in {output_dir}, so a new run starts there" in caplog.text
    assert not left_over.exists() and [os.path.basename(p) for p in checkpoint_folders(str(output_dir))] == [
        "checkpoint-2"
    ]

    caplog.clear()
    resumed = make(make_config, tokenizer, load_models, prompt_dataset, output_dir=str(output_dir))
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint="auto")  # the same command again
    assert f"Resuming from {output_dir / 'checkpoint-2'}: update 2" in caplog.text
    assert "a new run starts" not in caplog.text
    a, b = weights(straight), weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert logs_without_time(straight) == logs_without_time(resumed)


def test_auto_refuses_what_latest_refuses_and_deletes_nothing(
    three_checkpoints, make_config, tokenizer, load_models  # noqa: F811 (the fixture imported above)
):
    output_dir, _ = three_checkpoints
    another = build_trainer(make_config(seed=4), tokenizer, load_models)  # another run's settings
    with pytest.raises(ValueError, match="seed"):
        another.load_checkpoint("auto")
    for path in checkpoint_folders(output_dir):  # every checkpoint damaged: never started over
        with open(os.path.join(path, "scheduler.pt"), "ab") as handle:
            handle.write(b"x")
    trainer = build_trainer(make_config(), tokenizer, load_models)
    with pytest.raises(ValueError, match=r"`resume_from_checkpoint='auto'`: no checkpoint in .*verifies.*checkpoint-3"):
        trainer.load_checkpoint("AUTO")  # any case
    assert len(checkpoint_folders(output_dir)) == 3 and trainer.state.global_step == 0


def test_the_cli_checks_auto_before_loading_anything(tmp_path):
    """`--resume_from_checkpoint auto`: an empty folder passes the early checks (a fresh run), and so does one with
    a checkpoint; a folder holding a finished run's model and no checkpoint is refused as for a fresh run."""
    args = PPOConfig(output_dir=str(tmp_path), resume_from_checkpoint="auto", report_to="none")
    check_output_dir(args)
    check_resume_flag(args)
    (tmp_path / "trainer_state.json").write_text("{}")
    with pytest.raises(SystemExit, match="holds an earlier run"):
        check_output_dir(args)


def test_the_help_says_what_auto_does():
    text = " ".join(build_parser().format_help().split())
    assert "--resume_from_checkpoint VALUE `latest`, `auto` or a checkpoint folder." in text
    full = " ".join(build_parser().format_help(full=True).split())
    assert "`auto` does the same where a checkpoint exists and else starts the run" in full


def test_calls_counted_before_a_run_are_not_its_own(make_config, tokenizer, load_models, prompt_dataset):
    """`calls/timeouts` and `calls/retries` count this process's calls; those of an earlier run in the same process
    (here planted) must not show in this run's first update (they made logs order-dependent between tests)."""
    from trl_ppo import deadlines

    deadlines._count("retries", 3)
    deadlines._count("timeouts", 2)
    trainer = make(make_config, tokenizer, load_models, prompt_dataset)
    trainer.train()
    logged = [(h["calls/timeouts"], h["calls/retries"]) for h in trainer.state.log_history if "calls/retries" in h]
    assert logged and set(logged) == {(0, 0)}

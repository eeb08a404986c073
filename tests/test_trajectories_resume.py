"""Trajectory files that stay true (issue 53): an update dropped at SIGTERM is not written, an update that a resume
redoes is read once (its last copy), a partial last line (a write killed midway) is left out with a warning and cut
off before the next write, and a corrupt line elsewhere is still refused."""

import json
import logging
import os
import signal

import pytest
import torch
from test_resume import make
from transformers import TrainerCallback

from trl_ppo import trajectories, viewer
from trl_ppo.cli import main

BATCH = 8  # episodes per update of `test_resume.make` (4 per device x 2 accumulation steps)


def record(update: int, episode: int, copy: str = "first") -> dict:
    """A small record with every field the viewer draws; `copy` tells the copies of an update apart."""
    numbers = [0.5, -0.5]
    return {"update": update, "rank": 0, "episode": episode, "copy": copy, "response_ids": [3, 4], "model_mask": [1, 1],
            "turn_starts": [0], "score": 1.0, "rewards": numbers, "logprobs": numbers, "ref_logprobs": numbers,
            "values": numbers, "advantages": numbers, "returns": numbers}  # fmt: skip


def write(folder, update: int, copy: str = "first", episodes: int = 2) -> None:
    trajectories.write_update(str(folder), 0, [record(update, i, copy) for i in range(episodes)])


def copies(path) -> dict:
    """{update: [the copy of each of its episodes]} as the readers see the file."""
    return {update: [r["copy"] for r in records] for update, records in trajectories.read_updates(str(path)).items()}


def test_an_update_written_again_is_read_from_its_last_copy_and_the_abandoned_updates_after_it_are_not(tmp_path):
    path = trajectories.trajectory_file(str(tmp_path), 0)
    for update in (1, 2, 3):
        write(tmp_path, update)
    write(tmp_path, 3, "redone")  # killed after writing update 3, before its checkpoint: redone on resume
    assert copies(path) == {1: ["first"] * 2, 2: ["first"] * 2, 3: ["redone"] * 2}
    write(tmp_path, 2, "branch")  # resumed from an older checkpoint (1): the old run's 2 and 3 are abandoned
    assert copies(path) == {1: ["first"] * 2, 2: ["branch"] * 2}
    write(tmp_path, 3, "branch", episodes=3)
    assert copies(path) == {1: ["first"] * 2, 2: ["branch"] * 2, 3: ["branch"] * 3}
    data = viewer.page_data(str(tmp_path), viewer.trajectory_files(str(tmp_path)), limit=100)
    assert data["total"] == 7 and len(data["episodes"]) == 7
    assert [(u["update"], u["episodes"]) for u in data["updates"]] == [(1, 2), (2, 2), (3, 3)]
    sampled = viewer.page_data(str(tmp_path), viewer.trajectory_files(str(tmp_path)), limit=3)
    assert sampled["total"] == 7 and len(sampled["episodes"]) == 3  # the sample is drawn from the kept lines


def test_a_partial_last_line_is_left_out_with_a_warning_and_cut_off_before_the_next_write(tmp_path, caplog):
    path = trajectories.trajectory_file(str(tmp_path), 0)
    write(tmp_path, 1)
    with open(path, "a", encoding="utf-8") as file:  # killed while writing update 2's first record
        file.write(json.dumps(record(2, 0))[:40])
    with caplog.at_level(logging.WARNING):
        assert copies(path) == {1: ["first"] * 2}
    assert "line 3: the last line is cut short" in caplog.text
    data = viewer.page_data(path, [path], limit=100)
    assert data["total"] == 2 and [u["update"] for u in data["updates"]] == [1]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        write(tmp_path, 2, "resumed")  # the resumed run appends update 2: the partial line is removed first
    assert "its last line was cut short" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert copies(path) == {1: ["first"] * 2, 2: ["resumed"] * 2}
    assert not caplog.text
    # A last line that lost only its newline is a whole record: read, and given its newline before the next write.
    with open(path, "rb+") as file:
        file.truncate(file.seek(0, os.SEEK_END) - 1)
    assert copies(path) == {1: ["first"] * 2, 2: ["resumed"] * 2}
    write(tmp_path, 3)
    assert copies(path) == {1: ["first"] * 2, 2: ["resumed"] * 2, 3: ["first"] * 2}


def test_a_corrupt_line_before_the_last_is_refused_naming_it(tmp_path):
    path = trajectories.trajectory_file(str(tmp_path), 0)
    write(tmp_path, 1)
    with open(path, "a", encoding="utf-8") as file:  # a cut write with another appended to it (no repair)
        file.write(json.dumps(record(2, 0))[:40] + json.dumps(record(2, 0)) + "\n")
    write(tmp_path, 3)
    with pytest.raises(ValueError, match=r"line 3: not a JSON trajectory record"):
        trajectories.read_updates(path)
    with pytest.raises(SystemExit, match=r"trajectories-0.jsonl, line 3: not a JSON trajectory record"):
        main(["trajectories", "view", str(tmp_path), "-o", str(tmp_path / "page.html")])
    with open(path, "a", encoding="utf-8") as file:
        file.write("{not json\n" + json.dumps(record(4, 0)) + "\n")
    with pytest.raises(SystemExit, match=r"line 3: not a JSON trajectory record"):
        main(["trajectories", path])


def check_each_update_once(folder, updates: int) -> None:
    """Each update of the run in the file once, with its whole batch, its advantages recomputing exactly (the
    whitening of the batch that was logged); the viewer shows each episode once."""
    path = trajectories.trajectory_file(str(folder), 0)
    read = trajectories.read_updates(path)
    assert {update: [r["episode"] for r in records] for update, records in read.items()} == {
        update: list(range(BATCH)) for update in range(1, updates + 1)
    }
    for records in read.values():
        again = trajectories.recompute(records)
        torch.testing.assert_close(again.advantages.advantages, again.logged_advantages, atol=1e-5, rtol=0)
    data = viewer.page_data(str(folder), viewer.trajectory_files(str(folder)), limit=1000)
    shown = [(episode["update"], episode["episode"]) for episode in data["episodes"]]
    assert data["total"] == len(shown) == len(set(shown)) == updates * BATCH
    assert [(u["update"], u["episodes"]) for u in data["updates"]] == [(u, BATCH) for u in range(1, updates + 1)]


def sigterm_while_scoring(trainer, update: int) -> None:
    """SIGTERM while `update` is being scored: the update is dropped, the run checkpoints the one before, exits."""
    original_score = trainer.score

    def score(rollout, batch):
        if trainer.state.global_step == update - 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return original_score(rollout, batch)

    trainer.score = score


def test_an_update_dropped_at_sigterm_is_written_once_after_resume(
    make_config, tokenizer, load_models, prompt_dataset, tmp_path
):
    folder, run = tmp_path / "trajectories", str(tmp_path / "run")
    settings = dict(total_episodes=3 * BATCH, save_steps=100, output_dir=run, trajectory_dir=str(folder))
    trainer = make(make_config, tokenizer, load_models, prompt_dataset, **settings)
    sigterm_while_scoring(trainer, 2)
    with pytest.raises(SystemExit) as stopped:
        trainer.train()
    assert stopped.value.code == 0 and os.path.isdir(os.path.join(run, "checkpoint-1"))
    assert list(trajectories.read_updates(trajectories.trajectory_file(str(folder), 0))) == [1]  # 2 was dropped
    make(make_config, tokenizer, load_models, prompt_dataset, **settings).train(resume_from_checkpoint=True)
    check_each_update_once(folder, 3)
    main(["trajectories", "view", str(folder)])
    assert (folder / "trajectories.html").exists()


class CrashAfter(TrainerCallback):
    """A kill after update `step`'s records are written, before its checkpoint (as SIGKILL would land)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise RuntimeError("killed")


@pytest.mark.slow
def test_sigterm_then_a_kill_then_resumes_read_as_the_uninterrupted_run(
    make_config, tokenizer, load_models, prompt_dataset, tmp_path
):
    """SIGTERM while update 2 is scored (dropped; checkpoint-1), resumed and killed after writing update 4
    (checkpoint-2 is the last), resumed again (3 and 4 redone): the file reads as an uninterrupted run's does."""
    settings = dict(total_episodes=4 * BATCH, save_steps=2)
    straight_folder, folder, run = tmp_path / "straight", tmp_path / "trajectories", str(tmp_path / "run")
    make(make_config, tokenizer, load_models, prompt_dataset, output_dir=str(tmp_path / "straight_run"),
         trajectory_dir=str(straight_folder), **settings).train()  # fmt: skip
    settings |= dict(output_dir=run, trajectory_dir=str(folder))
    trainer = make(make_config, tokenizer, load_models, prompt_dataset, **settings)
    sigterm_while_scoring(trainer, 2)
    with pytest.raises(SystemExit):
        trainer.train()
    with pytest.raises(RuntimeError, match="killed"):
        make(make_config, tokenizer, load_models, prompt_dataset, callbacks=[CrashAfter(4)], **settings).train(
            resume_from_checkpoint=True
        )
    assert "checkpoint-2" in os.listdir(run) and "checkpoint-4" not in os.listdir(run)  # 3 and 4 are redone
    make(make_config, tokenizer, load_models, prompt_dataset, **settings).train(resume_from_checkpoint=True)
    check_each_update_once(folder, 4)
    straight = trajectories.read_updates(trajectories.trajectory_file(str(straight_folder), 0))
    assert trajectories.read_updates(trajectories.trajectory_file(str(folder), 0)) == straight

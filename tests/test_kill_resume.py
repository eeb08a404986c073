"""Crash consistency, kept (issue 46, part 2): `trl-ppo` SIGKILLed at random moments of a run that checkpoints every
update, then started again with the same command (`--resume_from_checkpoint auto`), ends with a final model
bit-identical to an uninterrupted run's; after every kill the checkpoints left verify and none newer was lost.
The harness is `benchmark/reliability/kill_resume.py`; its many-trial table is in docs/resuming.md."""

import os
import sys

import pytest
from conftest import REPO_ROOT

from trl_ppo.checkpoint import folders
from trl_ppo.checkpoint.folders import write_json
from trl_ppo.checkpoint.manifest import MANIFEST_NAME, manifest_of

sys.path.insert(0, os.path.join(REPO_ROOT, "benchmark", "reliability"))

import kill_resume  # noqa: E402


@pytest.mark.slow  # several `trl-ppo` processes, about 13 s: `make test` runs it, the quick loop does not
def test_runs_killed_at_random_moments_resume_to_the_uninterrupted_runs_model(tmp_path):
    result = kill_resume.run_trials(trials=2, kills=2, seed=46, workdir=str(tmp_path), updates=6)
    for record in result["trials"]:
        assert record["outcome"] == "identical" and not record["problems"], record
    assert sum(len(record["kills"]) for record in result["trials"]) >= 2


def test_the_table_counts_outcomes_and_where_kills_landed():
    records = [
        {"outcome": "identical", "problems": [], "kills": [{"landed": "before the first checkpoint"},
                                                           {"landed": "between checkpoints"}]},
        {"outcome": "refused", "problems": ["checkpoint-2: manifest.json is missing"], "kills": [
            {"landed": "between checkpoints"}]},
    ]
    table = kill_resume.outcome_table(records)
    assert "| trials: identical | 1 |" in table and "| trials: refused | 1 |" in table
    assert "| kills landing between checkpoints | 2 |" in table
    assert "| kills landing before the first checkpoint | 1 |" in table
    assert "| trials where a kill left a checkpoint that did not verify, or lost a newer one | 1 |" in table
    assert kill_resume.landing("killed", [5, 6], updates=6) == "after the last checkpoint, in the final save"
    assert kill_resume.landing("killed", [4, 5], updates=6) == "between checkpoints"
    assert kill_resume.landing("exited 0", [5, 6], updates=6) == "after the run had ended"


def fake_checkpoints(output_dir, steps) -> None:
    """`checkpoint-<n>` folders that verify: one file each, and its manifest."""
    for step in steps:
        folder = output_dir / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / "optimizer.pt").write_bytes(bytes([step]) * 100)
        write_json(str(folder / MANIFEST_NAME), manifest_of(str(folder)))


def test_a_kill_inside_a_rotation_leaves_no_half_deleted_checkpoint(tmp_path, monkeypatch):
    fake_checkpoints(tmp_path, [1, 2, 3])
    monkeypatch.setattr(folders.shutil, "rmtree", lambda *args, **kwargs: None)  # killed before the deletion
    folders.rotate_checkpoints(str(tmp_path), 2, keep=str(tmp_path / "checkpoint-3"))
    monkeypatch.undo()
    assert [os.path.basename(p) for p in folders.checkpoint_folders(str(tmp_path))] == ["checkpoint-2", "checkpoint-3"]
    (tmp_path / "checkpoint-1.replaced" / "optimizer.pt").unlink()  # ... or half-way through it
    assert folders.put_back_retired_checkpoints(str(tmp_path)) == []  # not whole: not put back
    assert folders.remove_unfinished_saves(str(tmp_path)) == [str(tmp_path / "checkpoint-1.replaced")]


def test_a_kill_between_setting_a_checkpoint_aside_and_replacing_it_loses_nothing(tmp_path):
    fake_checkpoints(tmp_path, [1, 2])
    os.replace(tmp_path / "checkpoint-2", tmp_path / "checkpoint-2.replaced")  # `replace_folder`'s first move
    (tmp_path / "tmp-checkpoint-2-run").mkdir()  # its replacement, not moved yet
    assert folders.put_back_retired_checkpoints(str(tmp_path)) == [str(tmp_path / "checkpoint-2")]
    assert folders.checkpoint_to_resume(str(tmp_path), "auto") == str(tmp_path / "checkpoint-2")
    assert folders.remove_unfinished_saves(str(tmp_path)) == [str(tmp_path / "tmp-checkpoint-2-run")]

"""Checkpoints that prove they are whole: the manifest, skipping a damaged newest checkpoint (and still resuming
bit for bit), refusing a damaged explicit one, never loading a default model config, cleaning up unfinished
saves, and a save that fails on a real write error (a file-size limit) keeping the earlier checkpoints."""

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_resume import logs_without_time, make, weights

from trl_ppo.checkpoint import STAGING_PREFIX
from trl_ppo.checkpoint.folders import write_json
from trl_ppo.checkpoint.manifest import MANIFEST_NAME, checkpoint_problem, manifest_of

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = dict(total_episodes=3 * 8, save_steps=1, logging_steps=1)  # 3 updates, a checkpoint after each


# ------------------------------------------------------------------------------------------- the manifest
def test_the_manifest_names_a_missing_truncated_or_changed_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.bin").write_bytes(b"0123456789")
    (tmp_path / "sub" / "b.json").write_text('{"x": 1}')
    write_json(str(tmp_path / MANIFEST_NAME), manifest_of(str(tmp_path)))
    manifest = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert manifest["files"]["a.bin"]["size"] == 10
    assert manifest["files"]["a.bin"]["sha256"] == "84d89877f0d4041efb6bf91a16f0248f2fd573e6af05c19f96bedb9f882f7882"
    assert set(manifest["files"]) == {"a.bin", "sub/b.json"}
    assert checkpoint_problem(str(tmp_path)) is None
    (tmp_path / "note.txt").write_text("a user's note")  # not listed: not checked
    assert checkpoint_problem(str(tmp_path)) is None

    (tmp_path / "a.bin").write_bytes(b"0123456780")  # same size, one byte changed
    assert "a.bin does not match its SHA-256" in checkpoint_problem(str(tmp_path))
    (tmp_path / "a.bin").write_bytes(b"01234")
    assert "a.bin has 5 bytes where 10 were written" in checkpoint_problem(str(tmp_path))
    (tmp_path / "a.bin").write_bytes(b"0123456789")
    (tmp_path / "sub" / "b.json").unlink()
    assert checkpoint_problem(str(tmp_path)).endswith(os.path.join("sub", "b.json") + " is missing")
    (tmp_path / MANIFEST_NAME).write_text('{"files": ')
    assert f"{MANIFEST_NAME} is damaged" in checkpoint_problem(str(tmp_path))
    (tmp_path / MANIFEST_NAME).unlink()
    assert checkpoint_problem(str(tmp_path)).endswith(f"{MANIFEST_NAME} is missing")


def test_a_checkpoint_is_hashed_once_while_its_files_stay_as_they_were(tmp_path, monkeypatch):
    """The CLI's early check and `train()`'s both verify the checkpoint: one hashing of its files, not two."""
    from trl_ppo.checkpoint import folders

    (tmp_path / "model.safetensors").write_bytes(b"0123456789")
    write_json(str(tmp_path / MANIFEST_NAME), manifest_of(str(tmp_path)))
    hashed = []
    monkeypatch.setattr(folders, "checkpoint_problem", lambda path: hashed.append(path) or checkpoint_problem(path))
    assert folders.verified_problem(str(tmp_path)) is None and folders.verified_problem(str(tmp_path)) is None
    assert len(hashed) == 1
    (tmp_path / "model.safetensors").write_bytes(b"01234")  # damaged in between: verified again, and refused
    assert "model.safetensors has 5 bytes where 10 were written" in folders.verified_problem(str(tmp_path))
    assert len(hashed) == 2


# ------------------------------------------------------------------- a damaged newest checkpoint is skipped
_RUNS = {}


@pytest.fixture
def crashed_run(make_config, tokenizer, load_models, prompt_dataset, tmp_path_factory):
    """(the straight 3-update trainer, an output_dir holding checkpoint-1 and -2 of a run stopped after update 2),
    made once for this module."""
    if not _RUNS:
        straight = make(make_config, tokenizer, load_models, prompt_dataset, **SETTINGS)
        straight.train()
        output_dir = str(tmp_path_factory.mktemp("crashed") / "out")
        first = make(make_config, tokenizer, load_models, prompt_dataset, output_dir=output_dir, **SETTINGS)
        first.args.num_total_batches = 2  # as if killed after update 2, with checkpoint-2 written
        first.train()
        _RUNS.update(straight=straight, output_dir=output_dir)
    return _RUNS["straight"], _RUNS["output_dir"]


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGES = {
    "config.json deleted": ("config.json", Path.unlink, "config.json is missing"),
    "model.safetensors truncated": ("model.safetensors", truncate, "model.safetensors has"),
    "model.safetensors changed": ("model.safetensors", flip_last_byte, "model.safetensors does not match"),
    "value model truncated": ("value_model/model.safetensors", truncate, "model.safetensors has"),
    "optimizer.pt truncated": ("optimizer.pt", truncate, "optimizer.pt has"),
    "scheduler.pt deleted": ("scheduler.pt", Path.unlink, "scheduler.pt is missing"),
    "rng state truncated": ("rng_state_0.pth", truncate, "rng_state_0.pth has"),
    "trainer_state.json truncated": ("trainer_state.json", truncate, "trainer_state.json has"),
    "trl_ppo_state.json truncated": ("trl_ppo_state.json", truncate, "trl_ppo_state.json has"),
    "manifest deleted": (MANIFEST_NAME, Path.unlink, f"{MANIFEST_NAME} is missing"),
}


# The quick loop checks one file deleted, one changed and one truncated; make test checks every kind of damage.
QUICK_DAMAGES = ("config.json deleted", "model.safetensors changed", "optimizer.pt truncated")


@pytest.mark.parametrize(
    "damage", [pytest.param(d, marks=() if d in QUICK_DAMAGES else pytest.mark.slow) for d in DAMAGES]
)
def test_a_damaged_newest_checkpoint_is_skipped_and_the_resume_is_bitwise_identical(
    damage, crashed_run, make_config, tokenizer, load_models, prompt_dataset, tmp_path, caplog
):
    straight, crashed_dir = crashed_run
    output_dir = tmp_path / "copy"
    shutil.copytree(crashed_dir, output_dir)
    name, harm, problem = DAMAGES[damage]
    harm(output_dir / "checkpoint-2" / name)
    (output_dir / f"{STAGING_PREFIX}3").mkdir()  # an interrupted save's left-over
    (output_dir / f"{STAGING_PREFIX}3" / "model.safetensors").write_bytes(b"partial")

    with pytest.raises(ValueError, match="is not a whole trl_ppo checkpoint") as refused:
        make(make_config, tokenizer, load_models, prompt_dataset, output_dir=str(output_dir), **SETTINGS).train(
            resume_from_checkpoint=str(output_dir / "checkpoint-2")
        )
    assert problem in str(refused.value) and "Nothing was loaded" in str(refused.value)

    resumed = make(make_config, tokenizer, load_models, prompt_dataset, output_dir=str(output_dir), **SETTINGS)
    with caplog.at_level(logging.WARNING, logger="trl_ppo"):
        resumed.train(resume_from_checkpoint=True)
    skipped = [r.getMessage() for r in caplog.records if "skipped newer checkpoint" in r.getMessage()]
    assert len(skipped) == 1 and "checkpoint-2: " in skipped[0] and problem in skipped[0]
    assert any("Removed 1 unfinished checkpoint folder" in r.getMessage() for r in caplog.records)
    assert not (output_dir / f"{STAGING_PREFIX}3").exists()
    assert resumed.state.global_step == 3
    a, b = weights(straight), weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert logs_without_time(straight) == logs_without_time(resumed)


def test_no_checkpoint_that_verifies_is_a_clear_error(
    crashed_run, make_config, tokenizer, load_models, prompt_dataset, tmp_path
):
    _, crashed_dir = crashed_run
    output_dir = tmp_path / "copy"
    shutil.copytree(crashed_dir, output_dir)
    (output_dir / "checkpoint-1" / "optimizer.pt").unlink()
    (output_dir / "checkpoint-2" / "config.json").unlink()
    trainer = make(make_config, tokenizer, load_models, prompt_dataset, output_dir=str(output_dir), **SETTINGS)
    with pytest.raises(ValueError, match=r"no checkpoint in .* verifies: \['checkpoint-2: .*config.json is missing'"):
        trainer.train(resume_from_checkpoint=True)
    with pytest.raises(ValueError, match="already holds checkpoints"):  # damaged ones are still the user's run
        trainer.train()


def run_script(*arguments) -> subprocess.CompletedProcess:
    """`python <script in tests/scripts or -c code> <arguments>`, offline, output captured."""
    script = arguments[0] if arguments[0] == "-c" else str(ROOT / "tests" / "scripts" / arguments[0])
    return subprocess.run(
        [sys.executable, script, *map(str, arguments[1:])],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


# --------------------------------------------------------------------------- never a default model config
LOAD_WITHOUT_CONFIG = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))  # a default 20B config would need far more
import os
from trl_ppo.checkpoint.weights import load_weights_into
from trl_ppo.default_job import build_tiny_models, build_word_tokenizer
policy, _ = build_tiny_models(build_word_tokenizer(), hidden_size=32)
policy.save_pretrained(sys.argv[1])
os.remove(os.path.join(sys.argv[1], "config.json"))
fresh, _ = build_tiny_models(build_word_tokenizer(), hidden_size=32)
load_weights_into(fresh, sys.argv[1])
same = all((a == b).all() for a, b in zip(policy.state_dict().values(), fresh.state_dict().values()))
print("LOADED", same, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, "MiB")
"""


@pytest.mark.slow
def test_loading_weights_never_falls_back_to_a_default_model_config(tmp_path):
    """Below the manifest (which refuses such a checkpoint first), the loader itself builds the saved weights on
    the live model's config, so even a folder without config.json loads at the tiny model's size."""
    done = run_script("-c", LOAD_WITHOUT_CONFIG, tmp_path / "policy")
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("LOADED"))
    assert line.split()[1] == "True"
    assert int(line.split()[2]) < 2048  # MiB of peak RSS


RESUME_DAMAGED = """
import resource, sys
sys.path.insert(0, sys.argv[2])
from preemptible_run import tiny_trainer
settings = dict(total_episodes=2 * 16, save_steps=1, callbacks=[])
if sys.argv[3] == "train":
    tiny_trainer(sys.argv[1], **settings).train()
else:
    resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))  # a default 20B config would need far more
    try:
        tiny_trainer(sys.argv[1], **settings).train(resume_from_checkpoint=sys.argv[1] + "/checkpoint-2")
    except ValueError as error:
        print("REFUSED", error)
    print("PEAK_MIB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
"""


@pytest.mark.slow
def test_an_explicit_damaged_checkpoint_is_refused_naming_the_file_with_memory_bounded(tmp_path):
    """The reported failure: config.json deleted from the checkpoint given by path made the resume build
    transformers' default (20B) config and be killed for memory. Now it is refused, naming the file, in a process
    whose address space is capped at 6 GiB, at the peak memory of a tiny run."""
    scripts = str(ROOT / "tests" / "scripts")
    trained = run_script("-c", RESUME_DAMAGED, tmp_path / "run", scripts, "train")
    assert trained.returncode == 0, trained.stderr[-3000:]
    (tmp_path / "run" / "checkpoint-2" / "config.json").unlink()
    resumed = run_script("-c", RESUME_DAMAGED, tmp_path / "run", scripts, "resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    refused = next(line for line in resumed.stdout.splitlines() if line.startswith("REFUSED"))
    assert str(tmp_path / "run" / "checkpoint-2" / "config.json") + " is missing" in refused
    peak = next(line for line in resumed.stdout.splitlines() if line.startswith("PEAK_MIB"))
    assert int(peak.split()[1]) < 2048


# ----------------------------------------------------------------------------------- a save that fails
@pytest.mark.slow
def test_a_save_that_fails_on_a_write_error_keeps_the_earlier_checkpoints(
    make_config, tokenizer, load_models, prompt_dataset, tmp_path
):
    """A real write error from the OS (a file-size limit set before checkpoint-2, so its model.safetensors
    cannot be written, as on a full disk): the run stops with an error naming the save and the cause, the
    partial folder is gone, checkpoint-1 is kept and resumes."""
    output_dir = tmp_path / "out"
    done = run_script("write_error_run.py", output_dir)
    assert done.returncode != 0
    assert "CheckpointSaveError: Saving checkpoint-2 failed (process 0: " in done.stderr, done.stderr[-3000:]
    assert "File too large" in done.stderr and "newest: " + str(output_dir / "checkpoint-1") in done.stderr
    assert sorted(p.name for p in output_dir.iterdir() if "checkpoint" in p.name) == ["checkpoint-1"]
    assert checkpoint_problem(str(output_dir / "checkpoint-1")) is None
    resumed = run_script("write_error_run.py", output_dir, "resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "DONE 3" in resumed.stdout and "Resuming from " + str(output_dir / "checkpoint-1") in resumed.stderr


def test_a_manifest_entry_without_a_size_names_the_manifest_and_the_entry(tmp_path):
    """A hand-edited or damaged manifest.json (issue 28, item 15): not a bare `KeyError: 'size'`."""
    (tmp_path / "a.bin").write_bytes(b"0123456789")
    manifest = manifest_of(str(tmp_path))
    del manifest["files"]["a.bin"]["size"]
    write_json(str(tmp_path / MANIFEST_NAME), manifest)
    problem = checkpoint_problem(str(tmp_path))
    assert f"{MANIFEST_NAME} is damaged: its entry for 'a.bin'" in problem and "integer `size`" in problem
    manifest["files"]["a.bin"] = "84d89877"  # an entry that is not a mapping
    write_json(str(tmp_path / MANIFEST_NAME), manifest)
    assert "its entry for 'a.bin' ('84d89877')" in checkpoint_problem(str(tmp_path))

"""Two runs in one `output_dir` (issue 36, item 1): a run takes the folder's run lock before it writes anything
there, so that of two runs started at the same moment one trains and the other is refused with
`CheckpointOfAnotherRunError`, the first run's checkpoints whole; a lock a crashed run left is recognised as
stale; each run stages its checkpoints in a folder of its own."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trl_ppo.checkpoint.folders import PPO_STATE_NAME, checkpoint_folders, read_json
from trl_ppo.checkpoint.manifest import checkpoint_problem

ROOT = Path(__file__).resolve().parents[1]
TRIALS = 6


@pytest.mark.slow
def test_two_runs_started_at_the_same_moment_in_one_output_dir(tmp_path):
    """Two processes, each starting `train()` (a checkpoint after every update) in the same folder at the same
    moment, `TRIALS` times. Before the run lock, most trials lost data: a published checkpoint that failed its
    manifest, or a run dying with `FileNotFoundError` in the other's staging folder."""
    script = ROOT / "tests" / "scripts" / "race_run.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    runs = [
        subprocess.Popen([sys.executable, str(script), str(tmp_path), str(rank), str(TRIALS)], env=env)
        for rank in (0, 1)
    ]
    assert [run.wait(timeout=600) for run in runs] == [0, 0]
    problems = []
    for trial in range(TRIALS):
        results = [json.loads((tmp_path / f"result-{trial}-{rank}.json").read_text()) for rank in (0, 1)]
        winners = [result for result in results if result["outcome"] == "ok"]
        losers = [result for result in results if result["outcome"] != "ok"]
        output_dir = str(tmp_path / f"trial-{trial}")
        checkpoints = checkpoint_folders(output_dir)
        damaged = [path for path in checkpoints if checkpoint_problem(path) is not None]
        owners = {read_json(os.path.join(path, PPO_STATE_NAME)).get("run_id") for path in checkpoints}
        if len(winners) != 1 or damaged or owners != {winners[0]["run_id"]} or len(checkpoints) != 2:
            problems.append((trial, results, damaged, sorted(os.listdir(output_dir))))
        elif losers[0]["outcome"] != "CheckpointOfAnotherRunError" or output_dir not in losers[0]["message"]:
            problems.append((trial, losers[0]))
    assert not problems, f"{len(problems)} of {TRIALS} trials went wrong: {problems}"


def test_the_run_lock_of_a_live_process_refuses_and_that_of_an_ended_one_is_taken_over(tmp_path):
    from trl_ppo.checkpoint import CheckpointOfAnotherRunError
    from trl_ppo.checkpoint.run_lock import LOCK_NAME, release_run_lock, take_run_lock

    output_dir = str(tmp_path / "out")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_THE_LOCK, output_dir],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert "locked\n" in iter(holder.stdout.readline, "")  # the lines before it: other libraries' notices
        with pytest.raises(CheckpointOfAnotherRunError, match=rf"process {holder.pid} on .*run run-a.*own `output_d"):
            take_run_lock(output_dir)
    finally:
        holder.kill()  # a crash: the lock file stays, naming a process that has ended
        holder.wait()
    assert os.path.isfile(os.path.join(output_dir, LOCK_NAME))
    assert take_run_lock(output_dir, "run-b")
    release_run_lock(output_dir)
    assert os.listdir(output_dir) == []


HOLD_THE_LOCK = """
import sys, time
from trl_ppo.checkpoint.run_lock import take_run_lock
take_run_lock(sys.argv[1], "run-a")
print("locked", flush=True)
time.sleep(600)
"""


def test_train_releases_the_run_lock_at_its_end_and_when_it_fails(make_config, tokenizer, load_models, prompt_dataset):
    from conftest import build_trainer

    from trl_ppo.checkpoint.run_lock import LOCK_NAME, holds_run_lock

    trainer = build_trainer(make_config(total_episodes=8), tokenizer, load_models, prompt_dataset)
    trainer.train()
    output_dir = trainer.args.output_dir
    assert not holds_run_lock(output_dir) and not os.path.exists(os.path.join(output_dir, LOCK_NAME))

    def fail(*args, **kwargs):
        assert holds_run_lock(output_dir)
        raise RuntimeError("the reward server is down")

    trainer = build_trainer(make_config(total_episodes=8, overwrite_output_dir=True), tokenizer, load_models,
                            prompt_dataset)
    trainer.score = fail
    with pytest.raises(RuntimeError, match="reward server"):
        trainer.train()
    assert not holds_run_lock(output_dir)

"""Deadlines that fit the run (issue 53, part 2), on two CPU processes (DDP over gloo, `accelerate launch`): a
reward function that hangs on one process ends the run with `UserCallError` on every process, well within
`ddp_timeout`, not with a collective timeout; deadlines whose retries would outlast `ddp_timeout` are refused on
every process before any compute."""

import json
import os
import subprocess
import sys
import time

import pytest
from test_distributed import CONFIGS, LAUNCH_ENV, ROOT, free_port

pytestmark = pytest.mark.distributed

SCRIPT = ROOT / "tests" / "scripts" / "hung_reward_run.py"
FLAGS = ["--per_device_train_batch_size", "4", "--total_episodes", "24", "--response_length", "6",
         "--num_ppo_epochs", "1", "--num_sample_generations", "0", "--logging_steps", "1", "--save_strategy", "no",
         "--report_to", "none", "--disable_tqdm", "true"]  # fmt: skip


def launch(report_dir, *flags: str) -> tuple[list[dict], float]:
    """Two processes of the script -> (each process's report, the launch's seconds)."""
    env = dict(os.environ, **LAUNCH_ENV, ACCELERATE_USE_CPU="true")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "multi_cpu.yaml"),
               "--main_process_port", str(free_port()), str(SCRIPT), "--report_dir", str(report_dir),
               "--output_dir", str(report_dir / "out"), *FLAGS, *flags]  # fmt: skip
    start = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    seconds = time.monotonic() - start
    reports = [json.loads(path.read_text()) for path in sorted(report_dir.glob("rank*.json"))]
    assert len(reports) == 2, f"{result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return reports, seconds


def test_a_reward_that_hangs_on_one_process_stops_every_process_with_its_error(tmp_path):
    """Rank 1's judge never answers from update 2 on; each try is interrupted at 1 s. `ddp_timeout` is 60 s: a
    collective timeout would take that long and name no function."""
    reports, _ = launch(tmp_path, "--hang_from", "2", "--reward_timeout", "1", "--user_call_retries", "1",
                        "--user_call_backoff", "0.1", "--ddp_timeout", "60")  # fmt: skip
    first, second = reports
    assert second["ended"].startswith("UserCallError: Update 2: Reward function 'judge' did not return within 1 s "
                                      "on each of its 2 tries"), second["ended"]
    assert first["ended"].startswith("UserCallError: Update 2: Another process's reward function 'judge' failed"), \
        first["ended"]
    assert first["updates"] == second["updates"] == 1
    assert max(first["seconds"], second["seconds"]) < 40  # the error, not the 60 s collective timeout


def test_deadlines_that_outlast_ddp_timeout_are_refused_on_every_process(tmp_path):
    reports, _ = launch(tmp_path, "--reward_timeout", "20", "--user_call_retries", "1", "--ddp_timeout", "30")
    for report in reports:
        assert report["ended"].startswith("ValueError: `reward_timeout` with `user_call_retries` lets one call take "
                                          "41 s (2 tries of 20 s, and the backoff), not less than `ddp_timeout` "
                                          "(30 s) in this run of 2 processes"), report["ended"]
        assert report["updates"] == 0

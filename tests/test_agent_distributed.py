"""Multi-turn episodes that need different numbers of turns on different processes finish without a hang
(issue 25, semantic 5): 2 CPU processes, DDP over gloo and DeepSpeed ZeRO-3. Run with `pytest -m distributed`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "agents_distributed_run.py"
FLAGS = [
    "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1", "--total_episodes", "8",
    "--local_rollout_forward_batch_size", "2", "--num_ppo_epochs", "1", "--max_turns", "3",
    "--response_length", "400", "--stop_token", "eos", "--num_sample_generations", "0", "--logging_steps", "1",
    "--save_strategy", "no", "--report_to", "none", "--seed", "5", "--disable_tqdm", "true",
]  # fmt: skip


# Without gathered weights every forward of ZeRO-3 sampling is a collective; one prompt per sampling call gives the
# process with two active episodes two calls per turn where the idle one has one: the calls must still pair up.
UNGATHERED = ["--ds3_gather_for_generation", "False", "--local_rollout_forward_batch_size", "1"]


# ZeRO-3 runs ungathered only: the stricter case (every forward a collective), with the same idle-row sampling as
# the gathered default; gathered sampling is tested in test_distributed's ZeRO-3 saving run.
@pytest.mark.usefixtures("torch_extensions")  # conftest: one DeepSpeed build for the session
@pytest.mark.parametrize("layout, extra", [("ddp", []), ("zero3", UNGATHERED)])
def test_processes_with_different_numbers_of_turns_finish_together(tmp_path, layout, extra):
    from test_distributed import CONFIGS, LAUNCH, LAUNCH_ENV, free_port

    config, extra_env, layout_flags, layout_accelerate_flags = LAUNCH[layout]
    env = dict(os.environ, **LAUNCH_ENV, **extra_env)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests" / "scripts")])
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config)]
    command += ["--main_process_port", str(free_port()), *layout_accelerate_flags]
    command += [str(SCRIPT), "--report_dir", str(tmp_path / "report")]
    command += ["--output_dir", str(tmp_path / "out"), *FLAGS, *layout_flags, *extra]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    reports = [json.loads((tmp_path / "report" / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    # Process 0's episodes end after one turn, process 1's play 3: per update, process 0 samples once (DDP) or
    # keeps sampling alongside (ZeRO-3, one idle row), and both finish.
    if layout == "zero3":
        assert reports[0]["sampler_calls"] == [2, 1, 1] * 2 and reports[1]["sampler_calls"] == [2, 2, 2] * 2
    else:
        assert reports[0]["sampler_calls"] == [2] * 2 and reports[1]["sampler_calls"] == [2, 2, 2] * 2
    logs = [[{k: v for k, v in e.items() if k != "eps"} for e in r["log_history"]] for r in reports]
    assert logs[0] == logs[1]
    turns = [entry["env/turns_mean"] for entry in logs[0] if "env/turns_mean" in entry]
    assert turns == [2.0, 2.0]  # gathered over both processes: (1 + 3) / 2
    first, second = (torch.load(tmp_path / "report" / f"weights_rank{rank}.pt") for rank in (0, 1))
    assert all(torch.equal(first[name], second[name]) for name in first)

"""The soak script (benchmark/reliability/soak.py, issue 46 part 4): its growth figures on hand-made samples, and
(slow) a short soak that stops the run with SIGTERM and resumes it until it ends."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, load_example_script

soak = load_example_script("soak", folder=os.path.join("benchmark", "reliability"))


def test_the_slope_is_least_squares_per_update():
    assert soak.slope([(0, 1.0), (1, 3.0), (2, 5.0)]) == pytest.approx(2.0)
    assert soak.slope([(0, 1.0), (1, 2.0), (2, 1.0)]) == pytest.approx(0.0)
    assert soak.slope([(5, 1.0), (5, 9.0)]) == 0.0  # no spread in x: no slope


def sample(update, start, rss, entries):
    return {"update": update, "start": start, "rss_mib": rss, "peak_rss_mib": rss, "fds": 4, "disk_mib": 5.0,
            "log_entries": entries, "state_bytes": 300 * entries}


def test_the_summary_reads_memory_growth_within_a_start_after_its_warm_up_only():
    # start 0: a warm-up jump, then +1 MiB per 100 updates (10 MiB per 1,000); start 1: a warm-up, then flat at a
    # lower level, and a preemption's save (update 1050, off the save_steps grid) that does not count
    samples = [sample(100 * i, 0, 400 if i == 1 else 500 + i, i) for i in range(1, 7)]
    samples += [sample(100 * i, 1, 300 if i == 7 else 450, i) for i in range(7, 11)] + [sample(1050, 1, 470, 11)]
    starts = [{"start": 0, "exit": 0, "seconds": 10, "stop_seconds": 1.0, "after_the_end": False},
              {"start": 1, "exit": -15, "seconds": 10, "stop_seconds": 0.5, "after_the_end": True}]
    text = soak.summary(samples, starts, save_steps=100, warmup=100)
    assert "after its first 100 updates, MiB per 1,000 updates: [10.0, 0.0]" in text
    assert "trainer_state bytes per log entry: 300 at update 100, 300 at update 1050" in text
    assert "| 1000 | 1 | 450 |" in text  # the sample nearest each thousand updates
    assert "exit codes [-15, 0], 1 signalled as the finished run exited" in text


@pytest.mark.slow
def test_a_short_soak_is_stopped_resumed_and_sampled(tmp_path):
    out = tmp_path / "soak.jsonl"
    command = [sys.executable, os.path.join(REPO_ROOT, "benchmark", "reliability", "soak.py"), "--updates", "30",
               "--save_steps", "10", "--segment_seconds", "6", "--out", str(out), "--work_dir", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    starts = [r for r in rows if r["kind"] == "start"]
    samples = [r for r in rows if r["kind"] == "sample"]
    assert len(starts) >= 2  # stopped by SIGTERM at least once, resumed
    assert all(s["exit"] == 0 or s["after_the_end"] for s in starts), starts
    assert samples[-1]["update"] == 30 and all(s["rss_mib"] > 0 and s["fds"] >= 3 for s in samples)
    assert (tmp_path / "run" / "model.safetensors").exists() and "RSS slope within a start" in done.stdout

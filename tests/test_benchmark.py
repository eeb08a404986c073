"""The benchmark in its small CPU form, as a smoke test that it runs (no timing is asserted)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmark", "bench_ppo.py")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmark", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_side_by_side_tiny_run_writes_rows_a_table_and_a_plot(tmp_path):
    pytest.importorskip("trl", reason="TRL 1.12 comes with the dev and bench extras")
    results = tmp_path / "results.jsonl"
    command = [sys.executable, BENCH, "--shape", "tiny", "--updates", "1", "--results", str(results)]
    command += ["--output_dir", str(tmp_path / "runs"), "--per_device_train_batch_size", "8"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert sorted(row["trainer"] for row in rows) == ["trl", "trl_ppo"]
    for row in rows:
        assert row["episodes_per_second"] > 0 and row["peak_memory_gib"] > 0 and len(row["scores"]) == 2
    assert "| tiny | fp32 |" in done.stdout and "speed-up" in done.stdout
    plot = tmp_path / "results.png"
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmark", "plot_results.py"), str(results), "-o", str(plot)],
        check=True,
        capture_output=True,
    )
    assert plot.stat().st_size > 10_000


def test_score_gain_is_the_last_updates_against_the_first():
    bench = _load("bench_ppo")
    scores = [1.0, 2.0, 0.0, 1.0, 1.0, 9.0, 3.0, 2.0, 4.0, 2.0, 3.0, 3.0]
    assert bench.score_gain(scores) == pytest.approx(2.8 - 1.0)
    assert bench.score_gain([1.0, 5.0, 2.0]) == pytest.approx(1.0)  # windows of 1 when there are few updates
    assert bench.parse_flags("train_forward_batch_size=64 bf16=true generation_backend=kv_cache") == {
        "train_forward_batch_size": 64,
        "bf16": True,
        "generation_backend": "kv_cache",
    }

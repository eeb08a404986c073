"""The benchmark in its small CPU form, as a smoke test that it runs (no timing is asserted)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmark", "speed", "bench_ppo.py")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmark", "speed", f"{name}.py"))
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
        [sys.executable, os.path.join(ROOT, "benchmark", "speed", "plot_results.py"), str(results), "-o", str(plot)],
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


@pytest.mark.slow
def test_a_stopped_run_resumes_from_its_checkpoint_and_goes_on(tmp_path):
    """What gpu_check.sh's "sharded" step does under each layout, in one CPU process: a 5-update run stopped after
    update 3 (checkpoint there), then a resume that trains updates 4 and 5; the resumed scores are those of an
    uninterrupted run."""
    common = [sys.executable, BENCH, "--worker", "trl_ppo", "--shape", "tiny", "--updates", "4"]
    common += ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1"]

    def run(*extra, output_dir):
        done = subprocess.run([*common, "--output_dir", str(output_dir), *extra], capture_output=True, text=True,
                              timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])

    stopped = run("--save_steps", "3", "--stop_after", "3", output_dir=tmp_path / "a")
    assert len(stopped["scores"]) == 3 and len(stopped["checkpoint_seconds"]) == 1
    resumed = run("--resume", output_dir=tmp_path / "a")
    assert (resumed["resumed_at_update"], resumed["final_update"]) == (4, 5)
    whole = run(output_dir=tmp_path / "b")
    assert whole["scores"] == stopped["scores"] + resumed["scores"]


def test_the_plot_leaves_out_sharded_layouts_and_other_checks(tmp_path):
    plot = _load("plot_results")
    row = {"device": "gpu", "shape": "1b", "precision": "bf16", "trainer": "trl_ppo", "episodes_per_second": 40.0}
    rows = [row, {**row, "episodes_per_second": 15.0, "layout": "zero3"}, {"check": "real_model", "device": "gpu"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = plot.median_rows([str(path)])
    assert table[("gpu", "1b", "bf16")]["trl_ppo"]["episodes_per_second"] == 40.0

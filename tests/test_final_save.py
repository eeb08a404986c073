"""The end of a run is protected too: a SIGTERM in the last update, while the curves are drawn or while the
final model is written, and a full disk while reporting, all leave the trained model on disk (`trl-ppo`, in a
subprocess: signals and exits are real)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent


def run(output_dir, moment):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    script = ROOT / "tests" / "scripts" / "final_save_run.py"
    done = subprocess.run(
        [sys.executable, str(script), str(output_dir), moment], capture_output=True, text=True, env=env, timeout=300
    )
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize(
    "moment, says",
    [
        ("last_update", "Saved the trained policy"),
        ("curves", "Saved the trained policy"),
        ("save", "SIGTERM during `save_model`: the model is saved in"),
        ("full_disk", "Could not write the run's log and curves: OSError"),
    ],
)
@pytest.mark.slow
def test_the_trained_model_survives_the_end_of_the_run(tmp_path, moment, says):
    code, output = run(tmp_path / "run", moment)
    assert code == 0, output[-4000:]
    assert says in output, output[-4000:]
    assert "Stopped by SIGTERM after update" not in output  # the run finished; no resume needed
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "run") is not None
    assert (tmp_path / "run" / "trainer_state.json").exists()
    if moment == "full_disk":
        assert "Could not write the model card: OSError" in output and "Saved the trained policy" in output
        assert not (tmp_path / "run" / "training_curves.png").exists()
    if moment == "save":
        assert "Saved the trained policy" not in output  # it exited right after the save, as the signal asked

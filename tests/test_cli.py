"""The ways users run training: the embedded default job, the example scripts and a TRL-style script, on local
models and local data (nothing from a hub)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from trl_ppo.cli import main
from trl_ppo.script_args import as_flags

ROOT = Path(__file__).resolve().parent.parent
SMALL_RUN = [
    "--per_device_train_batch_size",
    "4",
    "--gradient_accumulation_steps",
    "2",
    "--total_episodes",
    "16",
    "--response_length",
    "6",
    "--num_ppo_epochs",
    "1",
    "--local_rollout_forward_batch_size",
    "4",
    "--report_to",
    "none",
    "--save_strategy",
    "no",
    "--num_sample_generations",
    "1",
    "--per_device_eval_batch_size",
    "4",
    "--logging_steps",
    "1",
]


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    words = "the movie was good my day felt long our trip seemed fun".split()
    path.write_text(
        "".join(json.dumps({"prompt": " ".join(words[i % 9 : i % 9 + 2 + i % 3])}) + "\n" for i in range(40))
    )
    return str(path)


def run(args, **kwargs):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env, **kwargs
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout + result.stderr


def test_default_job_trains_and_saves(tmp_path, capsys):
    main(["--output_dir", str(tmp_path / "run"), "--total_episodes", "96", "--num_sample_generations", "2"])
    out = capsys.readouterr().out
    assert "Completions at update 0" in out and "Saved the trained policy" in out
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "run") is not None


def local_model_flags(model_paths, arch, prompts_file, output_dir):
    policy_path, value_path = model_paths[arch]
    return as_flags(
        {
            "model_name_or_path": policy_path,
            "sft_model_path": policy_path,
            "reward_model_path": value_path,
            "dataset_name": prompts_file,
            "output_dir": output_dir,
        }
    )


@pytest.mark.parametrize("script", ["examples/scripts/ppo.py", "examples/scripts/ppo_tldr.py"])
def test_example_scripts_on_local_models_and_data(script, model_paths, prompts_file, tmp_path):
    output = run([script, *local_model_flags(model_paths, "llama", prompts_file, str(tmp_path / "out")), *SMALL_RUN])
    assert "objective/scores" in output and "Completions" in output
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out") is not None


def test_trl_style_script_runs_with_only_the_import_changed(model_paths, prompts_file, tmp_path):
    flags = local_model_flags(model_paths, "gpt_neox", prompts_file, str(tmp_path / "out"))
    output = run(
        ["tests/scripts/trl_style_ppo.py", *flags, "--missing_eos_penalty", "1.0", "--stop_token", "eos", *SMALL_RUN]
    )
    assert "objective/scores" in output
    assert (tmp_path / "out" / "model.safetensors").exists()

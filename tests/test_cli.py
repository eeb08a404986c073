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


@pytest.mark.slow
def test_the_whole_default_job_is_a_healthy_run_by_the_readmes_table(tmp_path):
    """`make demo` as shipped (100 updates, under half a minute on 2 cores): each metric moves the way the README's
    "what healthy values look like" table says, and the completions learn to end (issue 18, item 6)."""
    main(["--output_dir", str(tmp_path / "run"), "--num_sample_generations", "0"])
    logged = [e for e in json.loads((tmp_path / "run" / "trainer_state.json").read_text())["log_history"]]
    logged = [e for e in logged if "objective/scores" in e]
    first, last = logged[0], logged[-1]
    assert len(logged) == 10
    assert first["objective/scores"] < 0 and last["objective/scores"] > 0.8  # of at most 1
    assert first["objective/kl"] < 1 and last["objective/kl"] < 10  # grows, then settles
    assert abs(last["objective/kl"] - logged[-3]["objective/kl"]) < 1
    assert last["loss/value_avg"] < first["loss/value_avg"] / 5  # falls, then stays low
    assert first["val/missing_stop_token_frac"] > 0.5 and last["val/missing_stop_token_frac"] < 0.05
    assert max(e["policy/approxkl_avg"] for e in logged) < 0.05
    assert max(e["policy/clipfrac_avg"] for e in logged) < 0.2
    assert all(0.9 < e["val/ratio"] < 1.1 for e in logged)


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


@pytest.mark.slow
@pytest.mark.parametrize("script", ["examples/scripts/ppo.py", "examples/scripts/ppo_tldr.py"])
def test_example_scripts_on_local_models_and_data(script, model_paths, prompts_file, tmp_path):
    output = run([script, *local_model_flags(model_paths, "llama", prompts_file, str(tmp_path / "out")), *SMALL_RUN])
    assert "objective/scores" in output and "Completions" in output
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out") is not None


@pytest.mark.slow
def test_trl_style_script_runs_with_only_the_import_changed(model_paths, prompts_file, tmp_path):
    flags = local_model_flags(model_paths, "gpt_neox", prompts_file, str(tmp_path / "out"))
    output = run(
        ["tests/scripts/trl_style_ppo.py", *flags, "--missing_eos_penalty", "1.0", "--stop_token", "eos", *SMALL_RUN]
    )
    assert "objective/scores" in output
    assert (tmp_path / "out" / "model.safetensors").exists()


def refusal(argv) -> str:
    """The message `trl-ppo` exits with (before any model is loaded)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    return str(exit_.value.code)


def test_malformed_yaml_names_file_line_and_column(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("learning_rate: 1e-5\nreport_to: [wandb\noutput_dir: out\n")
    message = refusal(["train", "--config", str(config)])
    assert message.startswith(f"trl-ppo: {config}:3:11: malformed YAML"), message


def test_model_flags_are_checked_before_loading(model_paths, tmp_path):
    policy_path, value_path = model_paths["gpt_neox"]
    message = refusal(["--model_name_or_path", policy_path, "--sft_model_path", policy_path])
    assert "--model_name_or_path needs --reward_model_path" in message
    for flag in ("model_name_or_path", "sft_model_path", "reward_model_path"):
        flags = {"model_name_or_path": policy_path, "sft_model_path": policy_path, "reward_model_path": value_path}
        flags[flag] = str(tmp_path / "no" / "such" / "model")
        message = refusal(as_flags(flags))
        assert (
            message == f"trl-ppo: --{flag} {flags[flag]}: no such folder (nor a hub id like `org/name`); give a "
            "model folder."
        ), message


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("prompts.txt", "the movie was\n", "unknown file type '.txt'; use one of .csv, .json, .jsonl, .parquet"),
        ("prompts.jsonl", "", "the file is empty"),
        ("missing.jsonl", None, "no such file"),
    ],
)
def test_a_local_prompts_file_that_cannot_be_read_is_named(tmp_path, name, content, message):
    from trl_ppo.cli import load_prompt_datasets
    from trl_ppo.script_args import ScriptArguments

    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit, match=rf"--dataset_name {path}: {message}"):
        load_prompt_datasets(ScriptArguments(dataset_name=str(path)))


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--totl_episodes", "5"], "trl-ppo: unknown option --totl_episodes (did you mean --total_episodes?)"),
        (["--total-episods=5"], "trl-ppo: unknown option --total-episods (did you mean --total_episodes?)"),
        (["--total_episodes", "abc"], "trl-ppo: argument --total_episodes/--total-episodes: invalid int value: 'abc'"),
        (["--total_episodes", "0"], "trl-ppo: `total_episodes` must be at least 1, got 0."),
        (["--kl_estimator", "k1", "--kl_coef", "-1"], "trl-ppo: `kl_coef` must be >= 0"),
        (["train", "extra"], "trl-ppo: unexpected argument 'extra'"),
        (["trian"], "trl-ppo: unknown command 'trian' (did you mean `train`?)"),
    ],
)
def test_cli_mistakes_exit_with_one_line_naming_the_flag(argv, expected, capsys):
    message = refusal(argv)
    assert message.startswith(expected) and "\n" not in message, message
    assert "Tokenizing" not in capsys.readouterr().err  # refused before any compute


def test_resume_latest_with_no_checkpoint_says_what_was_typed_before_any_compute(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    message = refusal(["--output_dir", str(empty), "--resume_from_checkpoint", "latest"])
    assert message.startswith(
        f"trl-ppo: `resume_from_checkpoint='latest'`: no complete checkpoint in `output_dir` ({empty})"
    ), message
    assert "\n" not in message and "leave `resume_from_checkpoint` out" in message
    assert "Tokenizing" not in capsys.readouterr().err and list(empty.iterdir()) == []
    message = refusal(["--output_dir", str(empty), "--resume_from_checkpoint", str(tmp_path / "nope")])
    assert message == f"trl-ppo: `resume_from_checkpoint` ({tmp_path / 'nope'}) is not a folder.", message


def test_only_the_first_process_of_a_machine_reads_the_checkpoint_early(tmp_path, monkeypatch):
    """Under `accelerate launch` the early check runs on LOCAL_RANK 0 only (the launcher stops the others if it
    exits); `train()` verifies the checkpoint again on the main process."""
    from trl_ppo import PPOConfig
    from trl_ppo.cli import check_resume_flag

    args = PPOConfig(output_dir=str(tmp_path), resume_from_checkpoint="latest", report_to="none")
    monkeypatch.setenv("LOCAL_RANK", "1")
    check_resume_flag(args)  # no checkpoint there, but not this process's to say
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit, match="no complete checkpoint"):
        check_resume_flag(args)


def test_bf16_without_a_bf16_gpu_names_the_flag_and_the_fix():
    from transformers.utils import is_torch_bf16_gpu_available

    if is_torch_bf16_gpu_available():
        pytest.skip("this machine runs bf16")
    message = refusal(["--bf16", "True"])
    assert message.startswith("trl-ppo: --bf16 True: this machine has no GPU that runs bf16. Add --use_cpu True")
    assert "\n" not in message


def test_a_mistyped_yaml_key_names_the_option_meant(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("lerning_rate: 0.1\n")
    assert "lerning_rate (did you mean learning_rate?)" in refusal(["--config", str(config)])


def help_text(flag, capsys, monkeypatch) -> list[str]:
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as exit_:
        main([flag])
    assert exit_.value.code in (0, None)
    return capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("argv", [["--help"], ["--no_such_flag", "1"]])
def test_help_and_refused_flags_print_no_thread_choice_first(argv, capsys, monkeypatch):
    """On a loaded machine `train` says how many CPU threads it chose: only once the flags are parsed, so that
    neither the help nor a refusal starts with that line."""
    from trl_ppo import cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "chosen_threads", lambda *args: 1)  # as on a machine whose cores are all busy
    chose = []
    monkeypatch.setattr(cpu_threads, "set_cpu_threads", lambda: chose.append(True))
    with pytest.raises(SystemExit):
        main(argv)
    assert not chose


def test_help_is_short_with_the_sub_commands_and_ppo_options_first(capsys, monkeypatch):
    import dataclasses

    from transformers import TrainingArguments

    from trl_ppo import PPOConfig
    from trl_ppo.cli_parser import DERIVED
    from trl_ppo.script_args import ScriptArguments

    lines = help_text("--help", capsys, monkeypatch)
    assert len(lines) < 335, len(lines)  # 999 lines, TrainingArguments' options first, before
    assert lines[0].startswith("usage: trl-ppo [train]")
    assert any(line.startswith("sub-commands:") for line in lines[:10])
    headings = [line for line in lines if line.endswith(":") and not line.startswith(" ")]
    assert headings[:4] == ["sub-commands:", "models and data:", "sampling:", "batch layout:"], headings
    assert headings[-1] == "general:" and lines[-1].endswith("trl-ppo --help-all")
    text = "\n".join(lines)
    assert "--adam_beta1" not in text and "--total-episodes" not in text  # one spelling per option
    trainer_fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    own = [f.name for f in dataclasses.fields(PPOConfig) if f.name not in trainer_fields | set(DERIVED.split())]
    for name in own + [f.name for f in dataclasses.fields(ScriptArguments)]:
        assert f"  --{name} " in text or text.count(f"  --{name}\n"), name  # every PPO and script option


def test_help_all_lists_every_option_in_sections_ppo_first(capsys, monkeypatch):
    from trl_ppo.cli_parser import CliParser

    lines = help_text("--help-all", capsys, monkeypatch)
    text = "\n".join(lines)
    for name in CliParser().option_names():
        assert f"--{name}" in text, name
    assert text.index("sampling:") < text.index("every other option (transformers.TrainingArguments):")
    assert text.index("--response_length") < text.index("--adam_beta1") < text.index("--local_mini_batch_size")


def test_a_reward_function_from_a_file_trains_a_local_model(model_paths, prompts_file, tmp_path, capsys):
    """`--reward_function file.py:name` instead of a reward model: no `--sft_model_path` needed (the policy is
    `--model_name_or_path`), the value function is a head on the policy's backbone."""
    reward_file = tmp_path / "my_rewards.py"
    reward_file.write_text("def shortness(prompts, completions, **_):\n    return [-len(c) / 9 for c in completions]\n")
    policy_path, _ = model_paths["llama"]
    flags = as_flags({"model_name_or_path": policy_path, "reward_function": f"{reward_file}:shortness",
                      "dataset_name": prompts_file, "output_dir": str(tmp_path / "out")})
    main([*flags, *SMALL_RUN])
    assert "objective/scores/shortness" in capsys.readouterr().out
    assert (tmp_path / "out" / "value_head.safetensors").exists()


def test_reward_function_flags_are_checked_before_loading(model_paths, tmp_path):
    policy_path, value_path = model_paths["gpt_neox"]
    base = ["--model_name_or_path", policy_path]
    both = refusal([*base, "--reward_model_path", value_path, "--reward_function", "math:sqrt"])
    assert both == "trl-ppo: --reward_function and --reward_model_path are both given: choose one reward."
    assert "no such file" in refusal([*base, "--reward_function", f"{tmp_path}/missing.py:f"])
    assert "has no function 'nope'" in refusal([*base, "--reward_function", "math:nope"])
    assert "cannot import" in refusal([*base, "--reward_function", "no_such_module_here:f"])
    assert "give `path/to/file.py:function`" in refusal([*base, "--reward_function", "no_colon"])

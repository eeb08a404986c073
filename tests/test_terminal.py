"""What the terminal shows is true (issue 38): prompts, completions and tool answers are shown as data (never as
rich markup), tool answers keep their `[tool]` marks, the tools' schemas are not repeated in every row, the final
table says how it was sampled, and the console logs print numbers as numbers."""

import os
from pathlib import Path

import pytest
import torch
from conftest import needs_tool_parsing, tiny_config
from datasets import Dataset
from test_agent_training import agent_trainer, scripted_sampler
from transformers import AutoModelForCausalLM

from trl_ppo import PPOTrainer
from trl_ppo.agents import runner as agent_runner_module
from trl_ppo.agents.tiny_chat import build_tool_tokenizer
from trl_ppo.completions import print_table

ROOT = Path(__file__).resolve().parent.parent


def test_closing_tags_in_a_cell_are_printed_not_parsed(capsys):
    print_table([{"query": "[INST] Review the film [/INST]", "model response": "[/b] done [tool]42[/tool]"}], "t [/x]")
    out = capsys.readouterr().out
    assert "[INST] Review the film [/INST]" in out and "[/b] done [tool]42[/tool]" in out and "t [/x]" in out


def test_a_llama_style_prompt_trains_and_shows_in_the_completions_table(make_config, capsys):
    """A prompt in the Llama-2/Mistral chat format crashed `train()` with rich's MarkupError at update 0."""
    tokenizer = build_tool_tokenizer()  # byte-level: the prompt decodes back to itself
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(tiny_config("qwen2", tokenizer))
    trainer = PPOTrainer(
        args=make_config(num_sample_generations=1, total_episodes=8, stop_token="eos", temperature=0.7),
        processing_class=tokenizer, model=policy, ref_model=None, value_model=None,
        reward_model=[lambda prompts, completions: [0.0] * len(completions)],
        train_dataset=Dataset.from_dict({"prompt": ["[INST] Review the film [/INST]"] * 8}),
    )
    trainer.train()
    out = capsys.readouterr().out
    assert "[INST] Review the film [/INST]" in out
    assert "Completions at update 0 (sampled at temperature 0.7)" in out


@needs_tool_parsing
def test_the_table_shows_tool_marks_and_no_tool_schemas(make_config, monkeypatch, capsys):
    tokenizer = build_tool_tokenizer()
    monkeypatch.setattr(agent_runner_module, "turn_sampler", scripted_sampler(tokenizer))
    monkeypatch.setattr(agent_runner_module.AgentRunner, "_lockstep", True)  # the script is the lockstep loop's sampler
    trainer = agent_trainer(make_config, tokenizer, lambda prompts, completions, **c: [0.0] * len(completions),
                            per_device_eval_batch_size=2)
    rows = trainer.generate_completions()
    out = capsys.readouterr().out
    assert "[tool]" in out and "[/tool]" in out
    assert all('"parameters"' not in row["query"] and "What is" in row["query"] for row in rows)
    assert '"parameters"' not in out  # no JSON schema of a tool anywhere in the table


def test_the_demo_real_config_does_not_call_its_sampled_final_table_greedy():
    config = (ROOT / "examples" / "configs" / "smollm2_sentiment.yaml").read_text()
    assert "greedy" not in config and "sampled at `temperature`" in config


@pytest.mark.parametrize("disable_tqdm", [False, True])
def test_console_logs_print_numbers_as_numbers(make_config, tokenizer, load_models, prompt_dataset, capsys,
                                               disable_tqdm):
    from conftest import build_trainer

    trainer = build_trainer(make_config(disable_tqdm=disable_tqdm), tokenizer, load_models, prompt_dataset)
    trainer.train()
    captured = capsys.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines() if "objective/kl" in line]
    assert lines, captured.out[-2000:] + captured.err[-2000:]
    assert all("': '" not in line for line in lines), lines  # no value printed as a quoted string
    assert "'episode': 8" in lines[0]


def test_tool_errors_are_summed_over_the_updates_of_a_log_as_documented():
    from trl_ppo.metrics import MetricsSinceLog

    window = MetricsSinceLog()
    for errors, kl in ((1.0, 0.2), (0.0, 0.4), (5.0, 0.6)):
        window.add({"env/tool_errors": errors, "objective/kl": kl})
    logs = window.pop()
    assert logs["env/tool_errors"] == 6.0 and logs["objective/kl"] == pytest.approx(0.4)


def test_help_shows_what_trl_ppo_does_with_the_model_paths_not_trls_defaults(capsys):
    from trl_ppo.cli import main

    for flag in ("--help", "--help-all"):
        with pytest.raises(SystemExit):
            main([flag])
        text = " ".join(capsys.readouterr().out.split())
        assert "--sft_model_path VALUE The policy (and reference) to train, by default --model_name_or_path" in text
        assert "--reward_model_path VALUE The reward model (it also starts the value model), required" in text
        assert "pythia-160m" not in text


def test_without_sft_model_path_the_policy_is_model_name_or_path():
    from trl_ppo.cli import check_model_flags, parse

    argv = ["--model_name_or_path", "org/policy", "--reward_model_path", "org/reward"]
    script_args, training_args, model_args, argv = parse(argv)
    check_model_flags(script_args, training_args, model_args, argv)
    assert training_args.sft_model_path == "org/policy" and training_args.reward_model_path == "org/reward"
    from trl_ppo import PPOConfig

    assert PPOConfig(output_dir="x").sft_model_path == "EleutherAI/pythia-160m"  # TRL's field default, kept


def test_resume_command_spells_out_the_run_folder_and_drops_the_flags_it_replaces():
    from trl_ppo.output_dirs import resume_command

    argv = ["--config", "a b.yaml", "--output_dir=old", "--overwrite_output_dir", "--seed", "3",
            "--resume_from_checkpoint", "x", "--overwrite-output-dir", "true"]
    assert resume_command(argv, "runs/2026-11-26_10-00-00") == (
        "trl-ppo train --config 'a b.yaml' --seed 3 --output_dir runs/2026-11-26_10-00-00 "
        "--resume_from_checkpoint latest"
    )


@pytest.mark.slow
def test_after_sigterm_the_cli_prints_the_command_that_resumes_this_run(tmp_path, monkeypatch, caplog):
    """The default job writes a new dated folder at every start, so `--resume_from_checkpoint latest` alone would
    look in a new, empty one: the message gives the command with the run's own folder, and that command resumes."""
    import os
    import shlex
    import signal

    from trl_ppo.cli import main

    monkeypatch.chdir(tmp_path)
    original_score = PPOTrainer.score

    def score(self, rollout, batch):
        if self.state.global_step == 1 and not getattr(self, "_signalled", False):
            self._signalled = True
            os.kill(os.getpid(), signal.SIGTERM)
        return original_score(self, rollout, batch)

    monkeypatch.setattr(PPOTrainer, "score", score)
    flags = ["--total_episodes", "128", "--num_sample_generations", "0"]
    with pytest.raises(SystemExit) as stopped:
        main(flags)
    assert stopped.value.code == 0
    err = caplog.text
    assert "Stopped by SIGTERM after update 1" in err and "train(resume_from_checkpoint=True)" not in err
    command = err.split("Resume with this command:\n  ", 1)[1].splitlines()[0]
    words = shlex.split(command)
    assert words[:4] == ["trl-ppo", "train", *flags[:2]] and words[-1] == "latest"
    run_folder = words[words.index("--output_dir") + 1]
    assert run_folder.startswith("trl_ppo_default_run/") and (tmp_path / run_folder / "checkpoint-1").is_dir()
    monkeypatch.setattr(PPOTrainer, "score", original_score)
    caplog.clear()
    main(words[2:])
    assert f"Resuming from {run_folder}/checkpoint-1" in caplog.text
    assert (tmp_path / run_folder / "trainer_state.json").is_file()


def divide_by_zero(x: int) -> float:
    """Divide by zero.

    Args:
        x: the numerator.
    """
    return x / 0


async def also_raises(x: int) -> str:
    """Fail asynchronously.

    Args:
        x: anything.
    """
    raise KeyError(f"missing {x}")


def test_a_raising_tool_warns_once_with_its_first_traceback(caplog):
    from trl_ppo.agents.execution import ToolCall, execute_calls
    from trl_ppo.agents.tools import toolbox

    tools = toolbox([divide_by_zero, also_raises])
    calls = [[ToolCall("divide_by_zero", {"x": 1}), ToolCall("also_raises", {"x": 2})]] * 2
    for _ in range(2):
        results = execute_calls(calls, [tools] * 2)
        assert all(result.error for episode in results for result in episode)  # still answers, not crashes
    warnings = [record.getMessage() for record in caplog.records if "raised (the model reads" in record.getMessage()]
    assert len(warnings) == 2, warnings  # one per tool, over four failures each
    first, second = sorted(warnings)
    assert "Tool 'also_raises'" in first and "KeyError: 'missing 2'" in first and "Traceback" in first
    assert "Tool 'divide_by_zero'" in second and "return x / 0" in second and "ZeroDivisionError" in second


@pytest.mark.parametrize(
    "environ, cores, load, default, expected",
    [
        ({}, 2, 6.4, 2, 1),  # two cores shared with six busy processes: one thread
        ({}, 16, 4.2, 16, 12),  # twelve cores left free
        ({}, 2, 0.1, 2, None),  # idle: torch's own choice
        ({"OMP_NUM_THREADS": "2"}, 2, 6.4, 2, None),  # the user's choice wins
    ],
)
def test_cpu_threads_follow_the_free_cores_unless_the_user_chose(environ, cores, load, default, expected):
    from trl_ppo.cpu_threads import chosen_threads

    assert chosen_threads(environ, cores, load, default) == expected


def test_trl_ppo_train_sets_the_threads_on_a_loaded_cpu(monkeypatch, capsys):
    from trl_ppo import cli

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(os, "getloadavg", lambda: (40.0, 40.0, 40.0))
    before = torch.get_num_threads()
    monkeypatch.setattr(cli, "run_default_job", lambda *args: None)
    try:
        torch.set_num_threads(2)  # torch's default on two cores
        cli.main(["train"])
        assert torch.get_num_threads() == 1
        assert "trl-ppo: 1 CPU thread(s) (load 40.0" in capsys.readouterr().out
    finally:
        torch.set_num_threads(before)

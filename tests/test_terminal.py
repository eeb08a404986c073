"""What the terminal shows is true (issue 38): prompts, completions and tool answers are shown as data (never as
rich markup), tool answers keep their `[tool]` marks, the tools' schemas are not repeated in every row, the final
table says how it was sampled, and the console logs print numbers as numbers."""

from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from conftest import needs_tool_parsing, tiny_config
from test_agent_training import agent_trainer, scripted_sampler, tool_policy
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

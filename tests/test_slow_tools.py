"""benchmark/agents/slow_tools.py's plumbing on fakes (SmolLM2 itself runs only in the benchmark): a cell's row is
built from what the tool task's trainers return, with every tool slowed and its schema kept."""

import inspect
import os

import pytest
from conftest import load_example_script

pytest.importorskip("trl.chat_template_utils", reason="the `templates` extra (trl) is not installed")
slow_tools = load_example_script("slow_tools", os.path.join("benchmark", "agents"))


def test_a_slowed_tool_sleeps_first_and_keeps_its_schema(monkeypatch):
    def multiply(a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first
            b: the second
        """
        return a * b

    slept = []
    monkeypatch.setattr(slow_tools.time, "sleep", slept.append)
    slowed = slow_tools.slowed(multiply, 0.2)
    assert slowed(3, b=4) == 12 and slept == [0.2]
    assert slowed.__name__ == "multiply" and slowed.__doc__ == multiply.__doc__
    assert inspect.signature(slowed) == inspect.signature(multiply)


@pytest.mark.parametrize("config", ["grpo", "trl_grpo"])
def test_a_cell_row_takes_the_trainers_success_curve(config, monkeypatch, tmp_path):
    import smollm2_tool as bench
    import transformers

    trained = []

    def train(args, tokenizer):  # the benchmark's trainers return (model, success curve, critic curves)
        trained.append(args.estimator)
        return None, [0.25, 0.5], {}

    monkeypatch.setattr(bench, "train_trl_ppo", train)
    monkeypatch.setattr(bench, "train_trl_grpo", train)
    monkeypatch.setattr(bench.task, "cached_warm_start", lambda *args: {"steps": 1})
    monkeypatch.setattr(bench.task, "TOOLS", bench.task.TOOLS)  # run_cell slows them in place
    monkeypatch.setattr(bench.agent, "config", bench.agent.config)  # ... and wraps the config for its rollout
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *args, **kwargs: None)
    monkeypatch.setattr(slow_tools, "ROOT", str(tmp_path))
    model = tmp_path / "model"  # what the parser checks for; nothing reads it (SmolLM2 may not be fetched yet)
    model.mkdir()
    (model / "config.json").write_text("{}")
    parse_args = bench.parse_args
    monkeypatch.setattr(bench, "parse_args", lambda argv: parse_args([*argv, "--model", str(model)]))
    row = slow_tools.run_cell(config, 0.2, updates=2, batch_size=4, seed=0)
    assert trained == [slow_tools.CONFIGS[config][0]]
    assert row["training_success"] == [0.25, 0.5] and row["episodes"] == 8
    assert row["warm_start_settings"] == {"steps": 1}
    assert row["episodes_per_cpu_s"] > 0 and row["peak_rss_gb"] > 0


def test_the_report_compares_each_cell_with_trl_at_its_delay_and_keeps_a_cells_last_row():
    report = load_example_script("slow_tools_report", os.path.join("benchmark", "agents"))
    row = lambda config, wall, cpu: {"delay": 1.0, "config": config, "episodes_per_wall_s": wall,  # noqa: E731
                                     "episodes_per_cpu_s": cpu, "peak_rss_gb": 5.0}  # fmt: skip
    rows = [row("trl_grpo", 0.1, 0.2), row("grpo-sampler", 0.1, 0.1), row("grpo-sampler", 0.15, 0.25)]
    lines = report.table(rows).splitlines()
    assert lines[2:] == ["| 1 s | `grpo-sampler` | 0.150 | 1.50 | 0.250 | 1.25 | 5.00 |",
                         "| 1 s | `trl_grpo` | 0.100 | 1.00 | 0.200 | 1.00 | 5.00 |"]  # fmt: skip

"""The tool-learning demo (examples/scripts/smollm2_tool_agent.py, `make demo-agent`) and its benchmark cell
(benchmark/agents/smollm2_tool.py), end to end on a tiny ChatML model: the reward, the refusals before any model is
loaded, a training run of each kind and the benchmark's row. SmolLM2 itself is trained in the benchmark only."""

import json
import os
import re

import pytest
import torch
from conftest import load_example_script, needs_tool_parsing, tiny_config

from trl_ppo.agents.tiny_chat import build_byte_tokenizer

pytest.importorskip("trl.chat_template_utils", reason="the `templates` extra (trl) is not installed")
pytestmark = needs_tool_parsing
agent = load_example_script("smollm2_tool_agent")
bench = load_example_script("smollm2_tool", os.path.join("benchmark", "agents"))


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tiny_chatml(tmp_path_factory):
    """A tiny Qwen2 model with a byte-level ChatML tokenizer whose template has no tool section (as SmolLM2's),
    saved as a model folder."""
    from transformers import AutoModelForCausalLM

    tokenizer = build_byte_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos_token="<|im_end|>",
                                     pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    config = tiny_config("qwen2", tokenizer)
    config.max_position_embeddings = 4096
    torch.manual_seed(0)
    folder = str(tmp_path_factory.mktemp("tiny_chatml"))
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_the_reward_reads_the_last_number_of_the_final_turn():
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1200, "b": 34}}\n</tool_call>'
    completions = [f"{call}The answer is 1,234.", f"{call}", "The answer is 1234, not 99.", "1234 is not -1234"]
    assert agent.answer_reward(None, completions, [1234] * 4) == [1.0, 0.0, 0.0, 0.0]
    # the number inside a call is not an answer: an episode that ends on a call scores 0


@pytest.mark.parametrize("argv, message", [
    (["--batch_size", "0"], "--batch_size must be at least 1"),
    (["--estimator", "grpo", "--batch_size", "6", "--num_generations", "4"], "must be a multiple of"),
    (["--updates", "-1"], "--updates and --save_steps must be at least 0"),
    (["--max_grad_norm", "-1"], "--max_grad_norm must be at least 0"),
    (["--model", "/nonexistent"], "get_smollm2.py first"),
    (["--estimator", "grpo", "--critic_learning_rate", "1e-3"], "needs --estimator gae"),
    (["--critic_learning_rate", "0"], "--critic_learning_rate must be > 0"),
])
def test_bad_arguments_are_refused_before_any_model_is_loaded(argv, message, capsys, tiny_chatml):
    with pytest.raises(SystemExit):
        agent.parse_args(["--model", tiny_chatml, *argv] if "--model" not in argv else argv)
    assert message in capsys.readouterr().err


def small_run(tiny_chatml, tmp_path, *extra):
    return ["--model", tiny_chatml, "--warm_start", str(tmp_path / "warm"), "--updates", "1", "--batch_size", "4",
            "--num_generations", "2", "--held_out", "2", "--eval_batch", "2", "--response_length", "24",
            "--max_turns", "2", *extra]


QUESTION = re.compile(r"What is \((\d+) \* (\d+)\) \+ (\d+)\?")
# The first 2 held-out problems and their answers by hand: (17 * 49) + 812 = 833 + 812, (31 * 72) + 478 = 2232 + 478.
HELD_OUT_ANSWERS = {(17, 49, 812): 1645, (31, 72, 478): 2710}


def question_in(tokenizer, context: list[int]) -> tuple[int, int, int]:
    return tuple(map(int, QUESTION.search(tokenizer.decode(context)).groups()))


def final_turn(tokenizer, value: int, max_new_tokens: int) -> list[int]:
    return tokenizer.encode(f"The answer is {value}.<|im_end|>", add_special_tokens=False)[:max_new_tokens]


def differs_from(folder: str):
    """-> whether a model's weights are no longer those saved in `folder` (read when asked: made by the run)."""

    def differs(model) -> bool:
        from transformers import AutoModelForCausalLM

        saved = AutoModelForCausalLM.from_pretrained(folder).state_dict()
        return any(not torch.equal(value, saved[name]) for name, value in model.state_dict().items())

    return differs


def script_evaluation(monkeypatch, tokenizer, trained, played):
    """Evaluation turns by a script: the held-out problem's answer (by hand) when `trained(model)`, else 0; each
    episode's (problem, trained) is appended to `played`. The reported success then says which model each
    evaluation played. (The tiny model's own greedy turns are played by the floor's test.)"""

    def evaluation(model, rendering, temperature, batch_size):
        is_trained = trained(model)

        def sample_turn(contexts, max_new_tokens):
            problems = [question_in(tokenizer, context) for context in contexts]
            played.extend((problem, is_trained) for problem in problems)
            return [final_turn(tokenizer, HELD_OUT_ANSWERS[p] if is_trained else 0, max_new_tokens) for p in problems]

        return sample_turn

    monkeypatch.setattr(agent.task.agent_task, "model_sampler", evaluation)


def script_training(monkeypatch, tokenizer):
    """trl_ppo's training turns by a script, every other episode answering right: the tiny model never does, so
    every reward would be 0 and an update would leave the weights as they were; each group of 2 now has a reward of
    1 and one of 0, a gradient."""
    from trl_ppo.agents import runner

    def training(models, sampling):
        def sample_turn(contexts, max_new_tokens):
            problems = [question_in(tokenizer, context) for context in contexts]
            return [final_turn(tokenizer, (a * b + c) * (i % 2 == 0), max_new_tokens)
                    for i, (a, b, c) in enumerate(problems)]

        return sample_turn

    monkeypatch.setattr(runner, "turn_sampler", training)
    monkeypatch.setattr(runner.AgentRunner, "_lockstep", True)  # the script is the lockstep loop's sampler


@pytest.mark.slow  # each about 5 s: `make test` runs them, the quick loop does not
@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_the_demo_warm_starts_trains_and_evaluates(estimator, tiny_chatml, tmp_path, capsys, monkeypatch):
    from transformers import AutoTokenizer

    played, tokenizer = [], AutoTokenizer.from_pretrained(tiny_chatml)
    script_training(monkeypatch, tokenizer)
    script_evaluation(monkeypatch, tokenizer, differs_from(str(tmp_path / "warm")), played)
    result = agent.main(small_run(tiny_chatml, tmp_path, "--estimator", estimator, "--output_dir",
                                  str(tmp_path / "run")))
    assert os.path.isfile(tmp_path / "warm" / "warm_start_done.txt")  # made once, then cached
    # the held-out problems played by the warm start (answered 0: success 0), then by the trained policy (answered
    # right: success 1)
    assert played == [(problem, trained) for trained in (False, True) for problem in HELD_OUT_ANSWERS]
    assert (result["before"]["success"], result["after"]["success"]) == (0.0, 1.0)
    assert result["after"]["calls_per_episode"] == 0.0  # the script answers without a call
    out = capsys.readouterr().out
    assert "Held-out success 0.00 -> 1.00" in out and f"[{estimator}: 1 updates of 4 episodes" in out


@pytest.mark.slow
def test_the_floor_is_the_model_without_tools_one_turn_on_its_own_template(tiny_chatml, tmp_path, capsys, monkeypatch):
    seen, floor_turns = [], []
    play, sampler = agent.task.agent_task.evaluate_prompts, agent.task.agent_task.model_sampler
    monkeypatch.setattr(agent.task.agent_task, "evaluate_prompts", lambda *a, **k: seen.append(a) or play(*a, **k))

    def floor_scripted(model, tokenizer, temperature, batch_size):
        """The floor's turns (the first evaluation's) scripted, the first problem answered right and the second not;
        the warm start's evaluation then plays the tiny model's own greedy turns."""
        if seen[1:]:
            return sampler(model, tokenizer, temperature, batch_size)

        def sample_turn(contexts, max_new_tokens):
            floor_turns.append([question_in(tokenizer, context) for context in contexts])
            return [final_turn(tokenizer, HELD_OUT_ANSWERS[p] if i == 0 else 0, max_new_tokens)
                    for i, p in enumerate(floor_turns[-1])]

        return sample_turn

    monkeypatch.setattr(agent.task.agent_task, "model_sampler", floor_scripted)
    result = agent.main(small_run(tiny_chatml, tmp_path, "--floor", "--updates", "0"))
    assert set(result) == {"floor", "before"}
    assert floor_turns == [list(HELD_OUT_ANSWERS)]  # one turn of both held-out problems
    assert result["floor"]["success"] == 0.5 and result["floor"]["calls_per_episode"] == 0.0  # 1 of 2 right
    assert "the model without tools (the floor): held-out success 0.50" in capsys.readouterr().out
    model, tokenizer, prompts, answers, tools, max_turns = seen[0][:6]  # the floor's, before the warm start's
    assert tools is None and max_turns == 1 and answers == list(HELD_OUT_ANSWERS.values())
    text = tokenizer.decode(prompts[0])
    assert text.startswith("<|im_start|>user\nWhat is (") and "multiply" not in text  # its own template, no tools
    assert seen[1][4] is not None  # the warm start is then played with the tools


@pytest.mark.slow
def test_a_benchmark_cell_appends_one_row_and_is_skipped_when_run_again(tiny_chatml, tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    argv = small_run(tiny_chatml, tmp_path, "--estimator", "rloo", "--out", str(out), "--work_dir",
                     str(tmp_path / "work"))
    bench.main(argv)
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["estimator"] == "rloo" and row["updates"] == 1 and len(row["training_success"]) == 1
    assert row["max_grad_norm"] == 0.0
    assert set(row["before"]) >= {"success", "tool_call_rate", "calls_per_episode", "tool_errors_per_episode"}
    assert (row["device"], row["peak_cuda_gib"]) == ("cpu", None) and row["episodes_per_wall_second"] > 0
    assert len(row["logprob_diff_mean"]) == 1 and row["logprob_diff_mean"][0] >= 0  # the engine's, one update
    assert any(name.startswith("evaluation_2_") for name in os.listdir(tmp_path / "warm"))  # cached
    bench.main(argv)
    assert "skipped" in capsys.readouterr().out and len(out.read_text().splitlines()) == 1


def test_the_critics_own_rate_reaches_the_trainer_and_names_the_run(tiny_chatml):
    args = bench.parse_args(["--model", tiny_chatml, "--critic_learning_rate", "1e-3"])
    assert args.output_dir.endswith("-clr0.001") and agent.config(args).critic_learning_rate == 1e-3
    assert agent.config(bench.parse_args(["--model", tiny_chatml])).critic_learning_rate is None


def test_the_lockstep_loop_reaches_the_trainer_names_the_run_and_is_refused_for_trl(tiny_chatml, capsys):
    args = bench.parse_args(["--model", tiny_chatml, "--agent_rollout", "lockstep"])
    assert args.output_dir.endswith("-lockstep") and agent.config(args).agent_rollout == "lockstep"
    default = bench.parse_args(["--model", tiny_chatml])
    assert not default.output_dir.endswith("-lockstep") and agent.config(default).agent_rollout == "continuous"
    assert bench.parse_args(["--model", tiny_chatml, "--estimator", "trl_grpo"]).agent_rollout is None
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", tiny_chatml, "--estimator", "trl_grpo", "--agent_rollout", "lockstep"])
    assert "TRL's GRPOTrainer plays its episodes its own way" in capsys.readouterr().err


def test_the_row_keeps_the_critics_explained_variance_per_update_and_turn():
    history = [{"objective/scores/answer_reward": 0.5, "val/explained_variance": 0.1,
                "val/explained_variance/turn_1": 0.2},
               {"loss": 1.0, "val/explained_variance": 9.0},  # not an update's log: left out
               {"objective/scores/answer_reward": 0.7, "val/explained_variance": -0.3}]
    assert bench.explained_variance_curves(history) == {"all": [0.1, -0.3], "turn_1": [0.2, None]}
    assert bench.explained_variance_curves([{"objective/scores/answer_reward": 0.5}]) == {}


def test_the_row_keeps_the_logprob_difference_and_the_offpolicy_weights_per_update():
    history = [{"objective/scores/answer_reward": 0.5, "rollout/logprob_diff_mean": 0.01,
                "rollout/logprob_diff_max": 0.2, "offpolicy/is_truncated_frac": 0.0},
               {"loss": 1.0, "rollout/logprob_diff_mean": 9.0},  # not an update's log: left out
               {"objective/scores/answer_reward": 0.7, "rollout/logprob_diff_mean": 0.03,
                "rollout/logprob_diff_max": 0.5, "offpolicy/is_truncated_frac": 0.125}]
    diff = "rollout/logprob_diff_"
    assert bench.logged_curves(history, diff) == {"logprob_diff_max": [0.2, 0.5], "logprob_diff_mean": [0.01, 0.03]}
    assert bench.logged_curves(history, "offpolicy/") == {"is_truncated_frac": [0.0, 0.125]}
    assert bench.logged_curves(history[:1] + [{"objective/scores/answer_reward": 0.7}], diff) == {}  # not every one
    assert bench.logged_curves([], diff) == {}


def test_a_gpu_cell_trains_in_bf16_names_its_run_and_is_refused_without_cuda(tiny_chatml, capsys, monkeypatch):
    import trl_ppo

    monkeypatch.setattr(agent, "cuda_available", lambda: False)
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", tiny_chatml, "--device", "cuda"])
    assert "--device cuda: torch sees no CUDA device here" in capsys.readouterr().err
    monkeypatch.setattr(agent, "cuda_available", lambda: True)
    args = bench.parse_args(["--model", tiny_chatml, "--device", "cuda"])
    assert args.output_dir.endswith("-cuda") and not bench.parse_args(["--model", tiny_chatml]).output_dir.endswith(
        "-cuda")
    monkeypatch.setattr(trl_ppo, "PPOConfig", lambda **fields: fields)  # a CPU cannot build a bf16 GPU config
    assert {k: agent.config(args)[k] for k in ("use_cpu", "bf16")} == {"use_cpu": False, "bf16": True}
    cpu = bench.parse_args(["--model", tiny_chatml])
    assert {k: agent.config(cpu)[k] for k in ("use_cpu", "bf16")} == {"use_cpu": True, "bf16": False}


@pytest.mark.slow
def test_an_asynchronous_cell_is_its_own_run_and_row(tiny_chatml, tmp_path):
    """`--max_staleness` reaches the trainer (the sampler process plays the episodes), names the run folder and the
    row, whose CPU seconds include the sampler process's; TRL's GRPO has no such option."""
    out = tmp_path / "rows.jsonl"
    argv = small_run(tiny_chatml, tmp_path, "--estimator", "gae", "--updates", "2", "--max_staleness", "1",
                     "--off_policy_correction", "tis", "--out", str(out), "--work_dir", str(tmp_path / "work"))
    assert bench.parse_args(argv).output_dir.endswith("-stale1tis")
    bench.main(argv)
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert (row["max_staleness"], row["off_policy_correction"], len(row["training_success"])) == (1, "tis", 2)
    assert row["train_wall_seconds"] > 0 and row["train_cpu_seconds"] > 0
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", tiny_chatml, "--estimator", "trl_grpo", "--max_staleness", "1"])


def test_the_trl_cross_check_is_refused_a_penalty_trl_does_not_have_and_records_no_kl(tiny_chatml, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", tiny_chatml, "--estimator", "trl_grpo", "--missing_eos_penalty", "1.0"])
    assert "TRL's GRPOTrainer has no such penalty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", tiny_chatml, "--estimator", "trl_grpo", "--skip_zero_gradient_steps"])
    assert "TRL's GRPOTrainer has no such option" in capsys.readouterr().err
    args = bench.parse_args(["--model", tiny_chatml, "--estimator", "trl_grpo"])
    assert args.kl_coef == 0.0 and args.num_generations == 4


def test_each_trainer_clips_gradients_as_its_own_default_unless_told_and_a_changed_clip_is_its_own_run(tiny_chatml):
    trl = bench.parse_args(["--model", tiny_chatml, "--estimator", "trl_grpo"])
    ours = bench.parse_args(["--model", tiny_chatml, "--estimator", "grpo"])
    assert (trl.max_grad_norm, ours.max_grad_norm) == (1.0, 0.0)  # `Trainer`'s default; trl_ppo's (PPOv2's)
    assert not ours.output_dir.endswith("clip0") and "clip" not in trl.output_dir
    clipped = bench.parse_args(["--model", tiny_chatml, "--estimator", "grpo", "--max_grad_norm", "1"])
    assert clipped.output_dir.endswith("-clip1")  # never resumes the unclipped run's checkpoints
    without_kl = bench.parse_args(["--model", tiny_chatml, "--estimator", "grpo", "--kl_coef", "0"])
    assert without_kl.output_dir.endswith("-kl0") and without_kl.output_dir != ours.output_dir
    skipping = bench.parse_args(["--model", tiny_chatml, "--estimator", "rloo", "--skip_zero_gradient_steps"])
    assert skipping.output_dir.endswith("-skip0") and agent.config(skipping).skip_zero_gradient_steps
    assert agent.config(clipped).max_grad_norm == 1.0 and agent.config(ours).max_grad_norm == 0.0


@pytest.mark.slow
def test_the_trl_cross_check_trains_from_the_same_warm_start_and_writes_a_row(tiny_chatml, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    trl = pytest.importorskip("trl")
    trained, played = [], []

    class Recorded(trl.GRPOTrainer):
        def __init__(self, *args, model, **kwargs):
            trained.append((model, differs_from(str(tmp_path / "warm"))(model)))
            super().__init__(*args, model=model, **kwargs)

    def is_trls(model) -> bool:  # the model TRL was given, trained in place
        return any(model is given for given, _ in trained)

    monkeypatch.setattr(trl, "GRPOTrainer", Recorded)
    script_evaluation(monkeypatch, AutoTokenizer.from_pretrained(tiny_chatml), is_trls, played)
    out = tmp_path / "rows.jsonl"
    bench.main(small_run(tiny_chatml, tmp_path, "--estimator", "trl_grpo", "--out", str(out), "--work_dir",
                         str(tmp_path / "work")))
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["estimator"] == "trl_grpo" and row["kl_coef"] == 0.0 and row["missing_eos_penalty"] is None
    assert row["max_grad_norm"] == 1.0  # TRL's (`Trainer`'s) default, passed on
    assert len(trained) == 1 and not trained[0][1]  # TRL was given the warm start as it was saved
    # the warm start played before (success 0), TRL's model after (success 1)
    assert played == [(problem, after) for after in (False, True) for problem in HELD_OUT_ANSWERS]
    assert len(row["training_success"]) == 1 and (row["before"]["success"], row["after"]["success"]) == (0.0, 1.0)


@pytest.mark.slow
def test_a_trl_cell_stopped_after_its_last_step_is_evaluated_without_another_step(tiny_chatml, tmp_path):
    """`Trainer` resumed from a checkpoint at `max_steps` takes one step more (TRL's seed 1 had 17 of 16): the
    cell loads that checkpoint instead, and its curve is the checkpoint's."""
    pytest.importorskip("trl")
    out, work = tmp_path / "rows.jsonl", tmp_path / "work"
    argv = small_run(tiny_chatml, tmp_path, "--estimator", "trl_grpo", "--out", str(out), "--work_dir", str(work),
                     "--save_steps", "1")
    bench.main(argv)
    first = json.loads(out.read_text())
    out.unlink()  # as if the process had stopped before writing its row
    bench.main(argv)
    again = json.loads(out.read_text())
    (run,) = os.listdir(work)
    assert [name for name in os.listdir(work / run) if name.startswith("checkpoint-")] == ["checkpoint-1"]
    assert again["resumed"] and again["training_success"] == first["training_success"]
    assert again["after"] == first["after"]  # the same trained model, evaluated greedily


def test_the_report_keeps_rows_of_other_settings_apart(tmp_path):
    report = load_example_script("smollm2_tool_report", os.path.join("benchmark", "agents"))
    summary = {"success": 0.0, "tool_call_rate": 1.0, "calls_per_episode": 2.0, "tool_errors_per_episode": 0.0}
    rows = [{"estimator": "gae", "seed": seed, "learning_rate": 3e-5, "updates": 16, "batch_size": 8,
             "missing_eos_penalty": penalty, "kl_coef": 0.05, "before": summary, "after": dict(summary, success=after),
             "training_success": [0.1, 0.5], "train_cpu_seconds": cpu, "resumed": cpu < 100}
            for seed, penalty, after, cpu in [(0, 1.0, 0.5, 100.0), (1, None, 1.0, 100.0), (2, None, 0.75, 60.0)]]
    rows += [dict(rows[1], seed=3, max_grad_norm=1.0), dict(rows[1], seed=4, kl_coef=0.0),
             dict(rows[1], seed=5, skip_zero_gradient_steps=True), dict(rows[1], seed=6, critic_learning_rate=1e-3)]
    lines = report.table(rows).splitlines()[2:]
    assert len(lines) == 6  # the penalised, clipped, KL-free, zero-gradient-skipping and critic-rate seeds: apart
    assert "| gae, zero-gradient steps skipped | 3e-05 |" in "\n".join(lines)
    assert "| gae (critic lr 0.001) | 3e-05 |" in "\n".join(lines)
    assert "| none | none | 0.05 | 2 | 0.00 -> 1.00, 0.00 -> 0.75 | +0.88 |" in "\n".join(lines)
    assert "| none | 1.0 | 0.05 | 1 | 0.00 -> 1.00 |" in "\n".join(lines)
    assert "| none | none | 0 | 1 | 0.00 -> 1.00 |" in "\n".join(lines)
    (pooled,) = [line for line in lines if "| 2 |" in line]
    assert pooled.endswith("| 100 (1 resumed, left out) |")  # a resumed run's CPU seconds are its last process's
    report.plot(rows, str(tmp_path / "plot.png"))
    assert (tmp_path / "plot.png").stat().st_size > 1000

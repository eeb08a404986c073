"""The Hugging Face tool chain around a run: YAML config files, `trl-ppo train/plot/env`, evaluation, trackers
(wandb offline, tensorboard: read back from their files), the curves PNG and the model card. No mocks."""

from __future__ import annotations

import glob
import json
import os
import struct
import time

import pytest
from PIL import Image
from test_cli import prompts_file, run  # noqa: E402, F401  (prompts_file is a fixture)

from trl_ppo import PPOConfig, PPOTrainer
from trl_ppo.cli import main, parse
from trl_ppo.default_job import build_tiny_models, build_word_tokenizer, default_prompts, positive_words_reward
from trl_ppo.reporting import PLOT_SIZE


def write_yaml(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_yaml_config_file_and_flags_that_override_it(tmp_path):
    config = write_yaml(
        tmp_path / "run.yaml",
        f"output_dir: {tmp_path / 'out'}\nlearning_rate: 0.001\nreport_to: [tensorboard, wandb]\n"
        "stop_token: eos\nwhiten_rewards: true\ndataset_name: prompts.jsonl\nsave_strategy: no\n",
    )
    script_args, training_args, _, _ = parse(["--config", config, "--learning_rate", "2e-5"])
    assert training_args.learning_rate == 2e-5  # the command line wins
    assert training_args.report_to == ["tensorboard", "wandb"]
    assert training_args.stop_token == "eos" and training_args.whiten_rewards is True
    assert script_args.dataset_name == "prompts.jsonl"
    assert training_args.save_strategy == "no"  # YAML's `no` is the option's value here, not False

    with pytest.raises(SystemExit, match=r"unknown option\(s\) in .*: lerning_rate"):
        parse(["--config", write_yaml(tmp_path / "bad.yaml", "lerning_rate: 0.1\n")])


@pytest.mark.slow
def test_trl_ppo_train_from_a_yaml_file_then_plot(tmp_path, model_paths, prompts_file):  # noqa: F811
    policy_path, value_path = model_paths["gpt_neox"]
    output_dir = tmp_path / "out"
    config = write_yaml(
        tmp_path / "run.yaml",
        "\n".join(
            [
                f"model_name_or_path: {policy_path}",
                f"sft_model_path: {policy_path}",
                f"reward_model_path: {value_path}",
                f"dataset_name: {prompts_file}",
                f"output_dir: {output_dir}",
                "per_device_train_batch_size: 4",
                "gradient_accumulation_steps: 2",
                "total_episodes: 32",
                "response_length: 6",
                "num_ppo_epochs: 1",
                "per_device_eval_batch_size: 4",
                "num_sample_generations: 0",
                "eval_strategy: steps",
                "eval_steps: 2",
                "logging_steps: 1",
                "save_strategy: 'no'",
                "report_to: none",
            ]
        ),
    )
    run(["-m", "trl_ppo", "train", "--config", config, "--learning_rate", "1e-3"])
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    assert [e["episode"] for e in history if "eval_objective/scores" in e] == [16, 32]
    card = (output_dir / "README.md").read_text()
    assert policy_path in card and prompts_file in card and "from_pretrained" in card
    assert "| `learning_rate` | 0.001 |" in card and "`objective/scores`" in card
    assert Image.open(output_dir / "training_curves.png").size == PLOT_SIZE

    output = run(["-m", "trl_ppo", "plot", str(output_dir), "--out", str(tmp_path / "curves.png")])
    assert "Wrote" in output
    with Image.open(tmp_path / "curves.png") as image:
        image.verify()
    assert Image.open(tmp_path / "curves.png").size == PLOT_SIZE


def test_env_names_the_versions_and_the_device(capsys):
    main(["env"])
    out = capsys.readouterr().out
    for name in ("torch", "transformers", "accelerate", "deepspeed", "peft", "device"):
        assert f"- {name}: " in out


def tiny_trainer(make_config, **overrides):
    """Two rewards (positive words, short responses), a separate value model, 10 evaluation prompts."""
    tokenizer = build_word_tokenizer()
    policy, value_model = build_tiny_models(tokenizer, hidden_size=32)
    split = default_prompts().train_test_split(test_size=10, seed=0)
    config = make_config(**{"num_ppo_epochs": 1, "stop_token": "eos", "disable_tqdm": True, **overrides})

    def short_text(prompts, completions, **kwargs):
        return [float(len(c.split()) <= 3) for c in completions]

    return PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=None,
        reward_model=[positive_words_reward, short_text],
        value_model=value_model,
        train_dataset=split["train"],
        eval_dataset=split["test"],
    )


def test_evaluate_alone_returns_the_documented_keys(make_config):
    trainer = tiny_trainer(make_config)
    metrics = trainer.evaluate()
    assert set(metrics) == {
        "eval_objective/scores",
        "eval_objective/kl",
        "eval_val/mean_response_length",
        "eval_val/stop_token_frac",
        "eval_objective/scores/positive_words_reward",
        "eval_objective/scores/short_text",
    }
    assert metrics["eval_objective/kl"] == 0.0  # before training the policy is its reference
    assert 1 <= metrics["eval_val/mean_response_length"] <= 6
    assert 0 <= metrics["eval_val/stop_token_frac"] <= 1
    expected = metrics["eval_objective/scores/positive_words_reward"] + metrics["eval_objective/scores/short_text"]
    assert metrics["eval_objective/scores"] == pytest.approx(expected, abs=1e-5)
    trainer.train()  # the baseline evaluation stays in the run's log (and so on its curves and model card)
    assert trainer.state.log_history[0]["eval_objective/scores"] == metrics["eval_objective/scores"]


def test_eval_strategy_epoch_is_refused(make_config):
    with pytest.raises(ValueError, match="`eval_strategy='epoch'` is not supported.*eval_steps"):
        tiny_trainer(make_config, eval_strategy="epoch")


def test_model_card_names_a_hub_base_model_in_its_header():
    from trl_ppo.reporting import model_card

    card = model_card("EleutherAI/pythia-1b-deduped", "trl-lib/tldr", ["reward_model"], {"seed": 1}, {}, None)
    assert "base_model: EleutherAI/pythia-1b-deduped" in card.split("---")[1]
    assert "**Base model:** EleutherAI/pythia-1b-deduped" in card


def test_eval_strategy_without_eval_dataset_is_refused(tmp_path):
    tokenizer = build_word_tokenizer()
    policy, value_model = build_tiny_models(tokenizer, hidden_size=32)
    config = PPOConfig(output_dir=str(tmp_path), eval_strategy="steps", eval_steps=1, report_to="none")
    with pytest.raises(ValueError, match=r"`eval_strategy=steps` \(or `eval_on_start`\) evaluates on `eval_dataset`"):
        PPOTrainer(config, tokenizer, policy, None, positive_words_reward, default_prompts(), value_model)


def wandb_records(run_file: str) -> list:
    """The records of an offline wandb run file (a LevelDB-style log of protobuf records: a 7-byte header, then
    32 KiB blocks of chunks with a 7-byte header each)."""
    from wandb.proto import wandb_internal_pb2

    data = open(run_file, "rb").read()
    assert data[:4] == b":W&B"
    block, position, chunks, pending = 32768, 7, [], b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a chunk header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind == 1:
            chunks.append(chunk)
        elif kind in (2, 3):
            pending += chunk
        elif kind == 4:
            chunks.append(pending + chunk)
            pending = b""
    records = []
    for raw in chunks:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        records.append(record)
    return records


def wandb_history_keys(run_file: str, deadline_s: float = 60.0) -> set[str]:
    """The metric names in the history records of a finished offline wandb run. `wandb.finish()` can return
    before wandb's service has written the file out (seen on a loaded machine), so this waits for the run's
    closing `exit` record before reading."""
    deadline = time.monotonic() + deadline_s
    records = wandb_records(run_file)
    while not any(record.WhichOneof("record_type") == "exit" for record in records):
        assert time.monotonic() < deadline, f"{run_file} holds no `exit` record after {deadline_s:.0f} s"
        time.sleep(0.2)
        records = wandb_records(run_file)
    keys = set()
    for record in records:
        if record.WhichOneof("record_type") == "history":
            keys.update("/".join(item.nested_key) if item.nested_key else item.key for item in record.history.item)
    return keys


def test_wandb_offline_and_tensorboard_runs_hold_the_metrics(tmp_path, make_config, monkeypatch):
    import wandb
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tensorboard"))
    trainer = tiny_trainer(
        make_config, report_to=["wandb", "tensorboard"], num_sample_generations=1, eval_strategy="steps", eval_steps=1
    )
    trainer.train()
    wandb.finish()

    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    keys = wandb_history_keys(run_file)
    assert {"train/objective/scores", "train/objective/kl", "train/loss/policy_avg"} <= keys
    assert any(key.startswith("completions/") for key in keys)
    (table,) = glob.glob(os.path.join(os.path.dirname(run_file), "files", "media", "table", "completions_*.json"))
    assert json.loads(open(table).read())["columns"] == ["query", "model response", "score"]

    (events,) = glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))
    accumulator = EventAccumulator(events)
    accumulator.Reload()
    scores = [event.value for event in accumulator.Scalars("train/objective/scores")]
    logged = [entry["objective/scores"] for entry in trainer.state.log_history if "objective/scores" in entry]
    assert scores == pytest.approx(logged)
    eval_scores = [event.value for event in accumulator.Scalars("eval/objective/scores")]  # shown as eval/...
    assert eval_scores == pytest.approx(
        [e["eval_objective/scores"] for e in trainer.state.log_history if "eval_objective/scores" in e]
    )
    assert "eval/objective/scores" in keys


def test_eps_is_episodes_per_second_to_three_significant_digits(make_config, tokenizer, load_models, prompt_dataset):
    """A run slower than one episode a second (a real model on a CPU) logs its true rate, not TRL's int 0."""
    from conftest import build_trainer
    from transformers import TrainerCallback

    class SlowClock(TrainerCallback):  # as if the run had started 1000 s ago: 8 episodes / 1000 s
        def on_train_begin(self, args, state, control, **kwargs):
            trainer._start_time -= 1000.0

    trainer = build_trainer(make_config(total_episodes=8), tokenizer, load_models, prompt_dataset)
    trainer.add_callback(SlowClock())
    trainer.train()
    eps = next(entry["eps"] for entry in trainer.state.log_history if "eps" in entry)
    assert isinstance(eps, float) and 0.0079 <= eps <= 0.008, eps
    assert eps == float(f"{eps:.3g}")

    from trl_ppo.metrics import episodes_per_second

    assert episodes_per_second(8, 20.0) == 0.4 and episodes_per_second(1, 3.0) == 0.333
    assert episodes_per_second(123456, 1.0) == 123000.0


def test_progress_bar_shows_eps_as_a_float():
    from trl_ppo.reporting import show_progress

    class Bar:
        def set_postfix(self, **values):
            self.postfix = values

    callback = type("Progress", (), {"training_bar": Bar()})()
    show_progress([callback], {"episode": 8, "eps": 0.0081, "objective/scores": 0.5, "objective/kl": 0.01})
    assert callback.training_bar.postfix["eps"] == "0.0081"


def test_every_curve_panel_has_data_from_a_run_without_evaluation(make_config, tokenizer, load_models, prompt_dataset):
    """The demo does not evaluate: each panel of `training_curves.png` still draws a metric the training logs."""
    from conftest import build_trainer

    from trl_ppo.reporting import CURVES

    trainer = build_trainer(make_config(total_episodes=8), tokenizer, load_models, prompt_dataset)
    trainer.train()
    logged = {name for entry in trainer.state.log_history for name in entry}
    assert [panel for panel, names in CURVES if not logged.intersection(names)] == []
    entry = next(entry for entry in trainer.state.log_history if "val/mean_response_length" in entry)
    assert 1 <= entry["val/mean_response_length"] <= 6  # response_length 6

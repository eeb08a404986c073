"""Configs: TRL's names and defaults, self-documenting fields, derived batch sizes and early errors."""

import copy
import dataclasses
import logging
import subprocess
import sys

import pytest
import torch
from conftest import build_trainer
from datasets import Dataset
from transformers import HfArgumentParser, TrainingArguments

from trl_ppo import ModelConfig, OnPolicyConfig, PPOConfig, PPOTrainer, ScriptArguments
from trl_ppo.config_checks import compute_batch_sizes, validate_config

TRL_DEFAULTS = dict(
    exp_name="ppo_config",
    model_adapter_name=None,
    ref_adapter_name=None,
    num_ppo_epochs=4,
    whiten_rewards=False,
    kl_coef=0.05,
    kl_estimator="k1",
    cliprange=0.2,
    vf_coef=0.1,
    cliprange_value=0.2,
    gamma=1.0,
    lam=0.95,
    ds3_gather_for_generation=True,
    run_name=None,
    dataset_num_proc=None,
    num_mini_batches=1,
    total_episodes=None,
    local_rollout_forward_batch_size=64,
    num_sample_generations=10,
    response_length=53,
    stop_token=None,
    stop_token_id=None,
    temperature=0.7,
    missing_eos_penalty=None,
    learning_rate=3e-6,
    world_size=None,
    num_total_batches=None,
    micro_batch_size=None,
    local_batch_size=None,
    batch_size=None,
    local_mini_batch_size=None,
    mini_batch_size=None,
)


def test_fields_keep_trl_names_and_defaults(tmp_path):
    config = PPOConfig(output_dir=str(tmp_path))
    for name, default in TRL_DEFAULTS.items():
        assert getattr(config, name) == default, name
    assert isinstance(config, OnPolicyConfig) and isinstance(config, TrainingArguments)
    assert {"reward_model_path", "sft_model_path"} <= {f.name for f in dataclasses.fields(PPOConfig)}


@pytest.mark.parametrize("cls", [PPOConfig, ScriptArguments, ModelConfig])
def test_every_own_field_has_help(cls):
    own = [
        f
        for f in dataclasses.fields(cls)
        if cls is not PPOConfig or f.name not in TrainingArguments.__dataclass_fields__ or f.name == "learning_rate"
    ]
    assert own
    for f in own:
        assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"


def test_cli_help_documents_ppo_options():
    result = subprocess.run([sys.executable, "-m", "trl_ppo", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for option in ("--kl_estimator", "--missing_eos_penalty", "--model_name_or_path", "--dataset_name", "--lam"):
        assert option in result.stdout
    assert "Lambda of generalized advantage estimation" in result.stdout


def test_parser_reads_trl_style_flags(tmp_path):
    parser = HfArgumentParser((ScriptArguments, PPOConfig, ModelConfig))
    script_args, config, model_args = parser.parse_args_into_dataclasses(
        args=[
            "--output_dir",
            str(tmp_path),
            "--dataset_name",
            "x.jsonl",
            "--kl_estimator",
            "k3",
            "--stop_token",
            "eos",
            "--missing_eos_penalty",
            "1.0",
            "--model_name_or_path",
            "m",
            "--use_peft",
            "--lora_r",
            "8",
            "--reward_weights",
            "1.0",
            "0.5",
            "--kl_target",
            "6",
        ]
    )
    assert (config.kl_estimator, config.stop_token, config.missing_eos_penalty) == ("k3", "eos", 1.0)
    assert config.reward_weights == [1.0, 0.5] and config.kl_target == 6.0 and config.kl_horizon == 10000
    assert script_args.dataset_name == "x.jsonl" and model_args.use_peft and model_args.lora_r == 8


def test_derived_batch_sizes(tmp_path):
    config = PPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=4,
        num_mini_batches=2,
        total_episodes=100,
    )
    compute_batch_sizes(config, world_size=2, train_dataset_len=1000)
    assert (config.local_batch_size, config.batch_size, config.micro_batch_size) == (16, 32, 8)
    assert (config.local_mini_batch_size, config.mini_batch_size) == (8, 16)
    assert config.num_total_batches == 4  # ceil(100 / 32)
    epochs = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_train_epochs=2)
    compute_batch_sizes(epochs, world_size=1, train_dataset_len=10)
    assert epochs.total_episodes == 20 and epochs.num_total_batches == 10


def test_inexact_division_names_both_numbers(tmp_path):
    config = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=3, num_mini_batches=2)
    with pytest.raises(ValueError, match=r"\(3\).*num_mini_batches` \(2\)"):
        compute_batch_sizes(config, world_size=1, train_dataset_len=100)
    config = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, train_forward_batch_size=3)
    with pytest.raises(ValueError, match=r"train_forward_batch_size` \(3\).*per_device_train_batch_size` \(2\)"):
        compute_batch_sizes(config, world_size=1, train_dataset_len=100)


def test_layouts_trl_accepts_are_accepted_with_its_meaning(tmp_path):
    """TRL cuts a minibatch into micro-batches of `per_device_train_batch_size`: a minibatch smaller than that is
    one micro-batch, and the last micro-batch may be smaller."""
    smaller = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_mini_batches=2)
    compute_batch_sizes(smaller, world_size=1, train_dataset_len=100)
    assert (smaller.local_mini_batch_size, smaller.train_forward_batch_size) == (2, 2)
    uneven = PPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=3, num_mini_batches=2
    )
    compute_batch_sizes(uneven, world_size=1, train_dataset_len=100)
    assert (uneven.local_mini_batch_size, uneven.train_forward_batch_size) == (6, 4)  # micro-batches of 4 and 2


def test_a_minibatch_smaller_than_a_micro_batch_updates_as_one_micro_batch(
    make_config, tokenizer, load_models, prompt_dataset
):
    """per_device_train_batch_size=4 with minibatches of 2 (TRL's meaning) trains exactly like micro-batches of 2."""
    weights = []
    for per_device, accumulation in ((4, 1), (2, 2)):
        config = make_config(
            per_device_train_batch_size=per_device,
            gradient_accumulation_steps=accumulation,
            num_mini_batches=2,
            total_episodes=4,
        )
        trainer = build_trainer(config, tokenizer, load_models, prompt_dataset)
        trainer.train()
        weights.append({k: v.clone() for k, v in trainer.model.state_dict().items()})
    for name in weights[0]:
        torch.testing.assert_close(weights[0][name], weights[1][name], msg=name)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(response_length=0), "response_length"),
        (dict(temperature=0.0), "temperature"),
        (dict(stop_token="</s>"), "stop_token"),
        (dict(stop_token="eos", stop_token_id=3), "both set"),
        (dict(missing_eos_penalty=-1.0), "missing_eos_penalty"),
        (dict(kl_estimator="k4"), "kl_estimator"),
        (dict(value_head_init="orthogonal"), "Unknown `value_head_init`"),
        (dict(lam=1.5), "lam"),
        (dict(kl_coef=-0.1), r"`kl_coef` must be >= 0, got -0.1"),
        (dict(vf_coef=-1.0), r"`vf_coef` must be >= 0, got -1.0"),
        (dict(cliprange=0.0), r"`cliprange` must be > 0, got 0.0"),
        (dict(cliprange_value=-0.2), r"`cliprange_value` must be > 0, got -0.2"),
        (dict(max_prompt_length=0), r"`max_prompt_length` must be at least 1"),
    ],
)
def test_bad_values_are_rejected(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        validate_config(PPOConfig(output_dir=str(tmp_path), **overrides))


def test_trainer_rejects_bad_inputs_before_training(make_config, tokenizer, load_models, prompt_dataset):
    policy, value_model, reward_model = load_models()
    common = dict(model=policy, ref_model=None, reward_model=reward_model, value_model=value_model)
    with pytest.raises(ValueError, match="neither an `input_ids` nor a `prompt`"):
        PPOTrainer(
            args=make_config(), processing_class=tokenizer, train_dataset=Dataset.from_dict({"text": ["a"]}), **common
        )
    with pytest.raises(ValueError, match="empty"):
        PPOTrainer(
            args=make_config(), processing_class=tokenizer, train_dataset=Dataset.from_dict({"prompt": []}), **common
        )
    with pytest.raises(ValueError, match="fewer than one batch"):
        PPOTrainer(
            args=make_config(), processing_class=tokenizer, train_dataset=prompt_dataset.select(range(5)), **common
        )
    no_pad = copy.deepcopy(tokenizer)
    no_pad.pad_token = None
    with pytest.raises(ValueError, match="no pad token"):
        PPOTrainer(args=make_config(), processing_class=no_pad, train_dataset=prompt_dataset, **common)
    with pytest.raises(TypeError, match="reward_model"):
        PPOTrainer(
            args=make_config(),
            processing_class=tokenizer,
            train_dataset=prompt_dataset,
            **{**common, "reward_model": "not a model"},
        )


@pytest.mark.parametrize("strategy, steps", [("save", 0), ("eval", 0), ("logging", -1)])
def test_interval_steps_of_zero_are_refused_where_used(tmp_path, strategy, steps):
    message = rf"`{strategy}_steps` must be > 0 with `{strategy}_strategy='steps'`, got {steps}"
    with pytest.raises(ValueError, match=message):
        PPOConfig(output_dir=str(tmp_path), **{f"{strategy}_strategy": "steps", f"{strategy}_steps": steps})
    PPOConfig(output_dir=str(tmp_path), **{f"{strategy}_strategy": "no", f"{strategy}_steps": steps})  # unused


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(response_length="12"), r"`response_length` must be an int, got '12' \(str\)"),
        (dict(seed="abc"), r"`seed` must be an int, got 'abc' \(str\)"),
        (dict(total_episodes=10.5), r"`total_episodes` must be an int or None, got 10.5 \(float\)"),
        (dict(kl_coef="0.05"), r"`kl_coef` must be a float, got '0.05' \(str\)"),
        (dict(bf16=1), r"`bf16` must be a bool, got 1 \(int\)"),
    ],
)
def test_a_value_of_the_wrong_type_names_the_field_when_the_config_is_made(tmp_path, overrides, message):
    with pytest.raises(TypeError, match=message):
        PPOConfig(output_dir=str(tmp_path), **overrides)
    PPOConfig(output_dir=str(tmp_path), learning_rate=1, total_episodes=None)  # an int is a float; None allowed


def test_values_a_user_may_mean_are_warned_about(make_config, tokenizer, load_models, prompt_dataset, caplog):
    with caplog.at_level(logging.WARNING):
        build_trainer(make_config(learning_rate=0.0, total_episodes=101 * 64), tokenizer, load_models, prompt_dataset)
    assert "`learning_rate` is 0" in caplog.text
    assert "makes 101 passes over the 64 prompts" in caplog.text
    no_eos = copy.deepcopy(tokenizer)
    no_eos.eos_token = None
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        config = make_config(stop_token="eos", missing_eos_penalty=1.0)
        build_trainer(config, no_eos, load_models, prompt_dataset)
    assert "`stop_token='eos'` with a tokenizer that has no EOS token" in caplog.text


def test_a_stop_token_outside_the_vocabulary_is_refused(make_config, tokenizer, load_models, prompt_dataset):
    with pytest.raises(ValueError, match=rf"`stop_token_id` \({len(tokenizer)}\) is outside the tokenizer's vocab"):
        build_trainer(make_config(stop_token_id=len(tokenizer)), tokenizer, load_models, prompt_dataset)


INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize(
    "overrides, field",
    [
        # Issue 28.1: each trained one update and saved a model of NaNs.
        (dict(entropy_coef=INF), "entropy_coef"),
        (dict(vf_coef=INF), "vf_coef"),
        (dict(vf_coef=1e38), "vf_coef"),
        (dict(kl_loss_coef=INF), "kl_loss_coef"),
        (dict(max_grad_norm=NAN), "max_grad_norm"),
        (dict(learning_rate=INF), "learning_rate"),
        (dict(weight_decay=INF), "weight_decay"),
        (dict(adam_epsilon=0.0), "adam_epsilon"),
        # Issue 28.7: a generic FloatingPointError at the first update, or torch's "probability tensor" error.
        (dict(missing_eos_penalty=NAN), "missing_eos_penalty"),
        (dict(missing_eos_penalty=INF), "missing_eos_penalty"),
        (dict(missing_eos_penalty=1e30), "missing_eos_penalty"),
        (dict(reward_weights=[1.0, NAN]), r"reward_weights\[1\]"),
        (dict(reward_weights=[INF]), r"reward_weights\[0\]"),
        (dict(reward_weights=[1e30]), r"reward_weights\[0\]"),
        (dict(kl_coef=NAN), "kl_coef"),
        (dict(kl_coef=INF), "kl_coef"),
        (dict(kl_coef=1e30), "kl_coef"),
        (dict(kl_target=6.0, kl_horizon=INF), "kl_horizon"),
        (dict(temperature=1e-65), "temperature"),
        (dict(temperature=NAN), "temperature"),
        # Issue 28.9: accepted silently.
        (dict(max_grad_norm=-1.0), "max_grad_norm"),
        (dict(temperature=INF), "temperature"),
        (dict(temperature=-0.7), "temperature"),
        (dict(kl_target=INF), "kl_target"),
        # Issue 28.15: seeds numpy and torch cannot take.
        (dict(seed=-1), "seed"),
        (dict(seed=2**32), "seed"),
        (dict(data_seed=-5), "data_seed"),
    ],
)
def test_nonfinite_and_absurd_numbers_are_refused_when_the_config_is_made(tmp_path, overrides, field):
    with pytest.raises(ValueError, match=rf"^`{field}` must"):
        PPOConfig(output_dir=str(tmp_path), **overrides)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(kl_coef=None), r"`kl_coef` must be a float, got None: it has no 'off' value; its default is 0.05"),
        (dict(learning_rate=None), r"`learning_rate` must be a float, got None"),
        (dict(num_ppo_epochs=None), r"`num_ppo_epochs` must be an int, got None"),
        (dict(reward_weights="1.0"), r"`reward_weights` must be a list of floats \(one per reward\) or None, got '1.0'"),
        (dict(reward_weights=[1.0, "2"]), r"`reward_weights\[1\]` must be a float, got '2' \(str\)"),
    ],
)
def test_none_or_a_string_where_a_number_belongs_names_the_field(tmp_path, overrides, message):
    with pytest.raises(TypeError, match=message):
        PPOConfig(output_dir=str(tmp_path), **overrides)


def test_the_bounds_let_the_extremes_of_sane_values_through(tmp_path):
    PPOConfig(
        output_dir=str(tmp_path),
        temperature=1e-6,
        kl_coef=1e3,
        vf_coef=1e3,
        missing_eos_penalty=0.0,
        reward_weights=[-1e3, 1e3],
        learning_rate=1.0,
        weight_decay=0.5,
        seed=2**32 - 1,
        max_grad_norm=0.0,
    )


def test_sampling_at_the_lowest_temperature_allowed_trains(make_config, tokenizer, load_models, prompt_dataset):
    config = make_config(temperature=1e-6, total_episodes=8, num_ppo_epochs=1)
    trainer = build_trainer(config, tokenizer, load_models, prompt_dataset)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss/value_avg" in entry]
    assert len(logged) == 1 and torch.isfinite(torch.tensor(logged[0]["loss/value_avg"]))


def test_max_steps_is_the_number_of_updates_and_overrides_total_episodes(tmp_path, caplog):
    """Issue 27.2: `trl-ppo --max_steps 3` ran the default job's 100 updates (total_episodes=3200, 32 a batch)."""
    config = PPOConfig(
        output_dir=str(tmp_path), max_steps=3, total_episodes=3200, per_device_train_batch_size=16,
        gradient_accumulation_steps=2,
    )
    with caplog.at_level(logging.WARNING):
        compute_batch_sizes(config, world_size=1, train_dataset_len=144)
    assert (config.num_total_batches, config.total_episodes) == (3, 96)
    assert "`max_steps` (3) overrides `total_episodes` (3200): 3 update(s) of `batch_size` (32) episodes" in caplog.text
    unset = PPOConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4)
    compute_batch_sizes(unset, world_size=2, train_dataset_len=1000)
    assert (unset.num_total_batches, unset.total_episodes) == (2, 16)
    assert "max_steps" in {f.name for f in dataclasses.fields(PPOConfig)}


def test_max_steps_bounds_a_training_run(make_config, tokenizer, load_models, prompt_dataset):
    trainer = build_trainer(make_config(total_episodes=64, max_steps=1), tokenizer, load_models, prompt_dataset)
    assert trainer.train().global_step == 1


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(load_best_model_at_end=True, eval_strategy="steps", save_strategy="steps"), "load_best_model_at_end"),
        (dict(auto_find_batch_size=True), "auto_find_batch_size"),
        (dict(neftune_noise_alpha=5.0), "neftune_noise_alpha"),
        (dict(label_smoothing_factor=0.1), "label_smoothing_factor"),
        (dict(torch_empty_cache_steps=10), "torch_empty_cache_steps"),
    ],
)
def test_trainer_features_the_ppo_loop_does_not_run_are_refused(tmp_path, overrides, field):
    with pytest.raises(ValueError, match=rf"`{field}=.*` is a feature of `Trainer.train\(\)` that `PPOTrainer` does"):
        validate_config(PPOConfig(output_dir=str(tmp_path), **overrides))


def test_fp16_on_a_cpu_says_it_has_no_effect(make_config, tokenizer, load_models, prompt_dataset, caplog):
    """Issue 27.3: fp16 on a CPU trained in float32 without a word (accelerate has no fp16 autocast there)."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU fp16 applies")
    with caplog.at_level(logging.WARNING):
        trainer = build_trainer(make_config(fp16=True), tokenizer, load_models, prompt_dataset)
    assert "`fp16=True` has no effect on cpu" in caplog.text and "computes in float32" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        trainer = build_trainer(make_config(bf16=True, use_cpu=True), tokenizer, load_models, prompt_dataset)
    assert "has no effect" not in caplog.text
    with trainer.accelerator.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16  # bf16 autocast applies on a CPU


def test_num_train_epochs_and_logging_first_step_act(make_config, tokenizer, load_models, prompt_dataset):
    """Issue 27.2's other `TrainingArguments` a user expects to act (the rest: tests of `eval_steps`,
    `save_total_limit`, `data_seed` and `use_cpu` elsewhere). Without `logging_first_step` only [16] is logged."""
    config = make_config(total_episodes=None, num_train_epochs=0.25, logging_steps=5, logging_first_step=True)
    trainer = build_trainer(config, tokenizer, load_models, prompt_dataset)  # 64 prompts, 8 a batch
    assert trainer.train().global_step == 2
    assert [entry["episode"] for entry in trainer.state.log_history if "loss/policy_avg" in entry] == [8, 16]

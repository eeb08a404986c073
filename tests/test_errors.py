"""Bad input fails before any rollout with an error naming the argument, the value and the fix; problems that
only show during training name the reward or the update."""

import logging
import os

import pytest
import torch
from conftest import tiny_config
from datasets import Dataset
from transformers import AutoModelForCausalLM

from trl_ppo import PPOTrainer
from trl_ppo.reward_functions import reward_function_scores


def build(make_config, tokenizer, load_models, dataset, config=None, **models):
    policy, value_model, reward_model = load_models()
    kwargs = dict(model=policy, ref_model=None, reward_model=reward_model, value_model=value_model)
    kwargs.update(models)
    return PPOTrainer(args=config or make_config(), processing_class=tokenizer, train_dataset=dataset, **kwargs)


def test_prompt_too_long_for_the_context(make_config, tokenizer, load_models):
    long_prompt = " ".join(["good"] * 125)  # the test models have 128 positions
    dataset = Dataset.from_dict({"prompt": [long_prompt] + ["the movie was"] * 15})
    with pytest.raises(ValueError, match=r"125 tokens.*`response_length` \(6\).*128 positions.*`max_prompt_length`"):
        build(make_config, tokenizer, load_models, dataset)


def test_max_prompt_length_cuts_and_says_how_many(make_config, tokenizer, load_models, caplog):
    dataset = Dataset.from_dict({"prompt": [" ".join(["good"] * 125)] * 3 + ["the movie was"] * 13})
    with caplog.at_level(logging.WARNING):
        trainer = build(make_config, tokenizer, load_models, dataset, make_config(max_prompt_length=20))
    assert "3 of 16 prompts in `train_dataset` were longer than `max_prompt_length` (20)" in caplog.text
    assert max(len(ids) for ids in trainer.train_dataset["input_ids"]) == 20


def test_total_episodes_smaller_than_one_batch_trains_one_batch_as_trl_does(
    make_config, tokenizer, load_models, prompt_dataset, caplog
):
    with caplog.at_level(logging.WARNING):
        trainer = build(make_config, tokenizer, load_models, prompt_dataset, make_config(total_episodes=5))
    assert "`total_episodes` (5) is smaller than one batch (`batch_size` = 8" in caplog.text
    assert trainer.args.num_total_batches == 1


def test_model_passed_as_its_own_reference(make_config, tokenizer, load_models, prompt_dataset):
    policy, value_model, reward_model = load_models()
    with pytest.raises(ValueError, match="`ref_model` shares trained weights with `model`"):
        build(make_config, tokenizer, load_models, prompt_dataset, model=policy, ref_model=policy)


@pytest.mark.parametrize("role", ["value_model", "reward_model"])
def test_model_without_a_scalar_head(role, make_config, tokenizer, load_models, prompt_dataset, model_paths):
    causal_lm = AutoModelForCausalLM.from_pretrained(model_paths["gpt_neox"][0])
    with pytest.raises(TypeError, match=f"{role.replace('_', ' ')}.*`score` head"):
        build(make_config, tokenizer, load_models, prompt_dataset, **{role: causal_lm})


def test_reward_model_on_a_smaller_vocabulary(make_config, tokenizer, load_models, prompt_dataset):
    _, _, reward_model = load_models()
    reward_model.resize_token_embeddings(50)
    with pytest.raises(ValueError, match=r"`reward_model` has 50 token embeddings but the tokenizer has \d+ tokens"):
        build(make_config, tokenizer, load_models, prompt_dataset, reward_model=reward_model)


def test_pad_token_missing_says_how_to_add_one(make_config, tokenizer, load_models, prompt_dataset):
    import copy

    no_pad = copy.deepcopy(tokenizer)
    no_pad.pad_token = None
    with pytest.raises(ValueError, match=r"no pad token.*add_special_tokens"):
        PPOTrainer(
            args=make_config(),
            processing_class=no_pad,
            model=load_models()[0],
            ref_model=None,
            reward_model=load_models()[2],
            value_model=load_models()[1],
            train_dataset=prompt_dataset,
        )


def nan_reward(prompts, completions, **columns):
    return [float("nan")] + [1.0] * (len(completions) - 1)


def short_reward(prompts, completions, **columns):
    return [1.0]


@pytest.mark.parametrize(
    "reward, message",
    [
        (nan_reward, r"Update 1: Reward 'nan_reward' returned 1 non-finite score"),
        (short_reward, r"Update 1: Reward function 'short_reward' returned 1 scores: .*, 8 here"),
    ],
)
def test_bad_reward_values_name_the_reward_and_the_update(
    reward, message, make_config, tokenizer, load_models, prompt_dataset
):
    trainer = build(make_config, tokenizer, load_models, prompt_dataset, reward_model=reward)
    with pytest.raises(ValueError, match=message):
        trainer.train()


def test_reward_errors_outside_an_update_say_where_they_happened(make_config, tokenizer, load_models, prompt_dataset):
    """Decided: errors from `evaluate()` and the completions table name those, with the update they follow, not the
    next training update."""
    trainer = build(make_config, tokenizer, load_models, prompt_dataset, reward_model=short_reward)
    trainer.eval_dataset = trainer.train_dataset
    with pytest.raises(ValueError, match=r"^Evaluation before training: Reward function 'short_reward' returned 1"):
        trainer.evaluate()
    with pytest.raises(ValueError, match=r"^Completions table at update 0: Reward function 'short_reward'"):
        trainer.generate_completions()
    trainer.state.global_step = 3  # as after three updates
    with pytest.raises(ValueError, match=r"^Evaluation after update 3: Reward function 'short_reward'"):
        trainer.evaluate()


def _poison_training_values(trainer):
    """NaN values from the value head, but only in training forwards (with gradients)."""
    head = trainer.accelerator.unwrap_model(trainer.model).value_model.score
    return head.register_forward_hook(lambda m, i, out: out * float("nan") if torch.is_grad_enabled() else out)


def test_nonfinite_loss_stops_with_the_update_and_last_checkpoint(make_config, tokenizer, load_models, prompt_dataset):
    config = make_config(total_episodes=16, save_strategy="steps", save_steps=1)
    trainer = build(make_config, tokenizer, load_models, prompt_dataset, config)
    state = {"hook": None}

    from transformers import TrainerCallback

    class PoisonAfterFirstUpdate(TrainerCallback):
        def on_step_end(self, args, s, control, **kwargs):
            if s.global_step == 1:
                state["hook"] = _poison_training_values(trainer)

    trainer.add_callback(PoisonAfterFirstUpdate())
    with pytest.raises(FloatingPointError, match=r"Non-finite PPO loss at update 2.*checkpoint-1"):
        trainer.train()


def test_skip_nonfinite_updates_counts_the_skips(make_config, tokenizer, load_models, prompt_dataset):
    trainer = build(
        make_config, tokenizer, load_models, prompt_dataset, make_config(total_episodes=16, skip_nonfinite_updates=True)
    )
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    _poison_training_values(trainer)
    trainer.train()
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items()), "no step with a NaN loss"
    assert [e["loss/skipped_updates"] for e in trainer.state.log_history if "episode" in e] == [1, 2]


def test_responses_that_never_stop_are_reported(make_config, tokenizer, load_models, prompt_dataset):
    trainer = build(
        make_config,
        tokenizer,
        load_models,
        prompt_dataset,
        make_config(total_episodes=8, stop_token="eos", response_length=2),
    )
    trainer.train()
    fraction = trainer.state.log_history[-1]["val/missing_stop_token_frac"]
    assert 0.5 < fraction <= 1.0  # two tokens rarely reach EOS


def test_what_the_launch_configuration_cannot_do_is_refused(make_config):
    from trl_ppo.distributed import check_supported

    config = make_config(early_stopping=True, ratio_threshold=2.0)
    with pytest.raises(ValueError, match=r"`early_stopping`, `ratio_threshold` cannot be used under DeepSpeed"):
        check_supported(config, deepspeed_enabled=True)
    check_supported(config, deepspeed_enabled=False)  # both work without DeepSpeed
    check_supported(config, deepspeed_enabled=False, fsdp_version=2)  # and under FSDP2 (trl_ppo steps itself)
    check_supported(make_config(), deepspeed_enabled=True)
    with pytest.raises(ValueError, match=r"FSDP version 1 is not supported.*`fsdp_version: 2`.*fsdp2\.yaml"):
        check_supported(make_config(), deepspeed_enabled=False, fsdp_version=1)
    with pytest.raises(ValueError, match=r"ZeRO-3 the reference cannot share layers.*num_shared_layers=None"):
        check_supported(make_config(), deepspeed_enabled=True, zero_stage=3, shared_reference=True)
    with pytest.raises(ValueError, match=r"FSDP2 the reference cannot share layers.*num_shared_layers=None"):
        check_supported(make_config(), deepspeed_enabled=False, fsdp_version=2, shared_reference=True)
    check_supported(make_config(), deepspeed_enabled=True, zero_stage=2, shared_reference=True)


def test_fsdp2_settings_that_cannot_work_are_refused():
    from types import SimpleNamespace

    from trl_ppo.fsdp import check_settings

    def accelerator(**plugin):
        return SimpleNamespace(state=SimpleNamespace(fsdp_plugin=SimpleNamespace(**plugin)))

    with pytest.raises(ValueError, match=r"`fsdp_cpu_ram_efficient_loading: true` is not supported.*Set it to false"):
        check_settings(accelerator(fsdp_version=2, cpu_ram_efficient_loading=True))
    check_settings(accelerator(fsdp_version=2, cpu_ram_efficient_loading=False))
    check_settings(SimpleNamespace(state=SimpleNamespace()))  # no FSDP


@pytest.mark.parametrize(
    "written, files, launched",
    [
        ("DeepSpeed", ["global_step2/mp_rank_00_model_states.pt"], None),
        ("FSDP", ["pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata", "scheduler.pt"], None),
        ("FSDP", ["pytorch_model_fsdp.bin", "optimizer.bin", "scheduler.pt"], "DeepSpeed"),
        (None, ["optimizer.pt", "scheduler.pt"], "FSDP"),
    ],
)
def test_a_checkpoint_resumes_only_under_the_layout_that_wrote_it(tmp_path, written, files, launched):
    from trl_ppo.checkpoint import read_run_state
    from trl_ppo.checkpoint.folders import PPO_STATE_NAME, write_json

    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    write_json(str(tmp_path / PPO_STATE_NAME), {"identity": {"config": {}}, "kl_coef": 0.1})
    with pytest.raises(ValueError, match=rf"was written {'with ' + written if written else 'without'}.*launched"):
        read_run_state(str(tmp_path), {"config": {}}, launched)
    assert read_run_state(str(tmp_path), {"config": {}}, written) == {"kl_coef": 0.1}


def test_no_reference_can_be_copied_from_a_policy_partitioned_at_load(load_models):
    from trl_ppo.models import prepare_models

    policy, value_model, reward_model = load_models()
    for parameter in policy.parameters():
        parameter.ds_id = 0  # what DeepSpeed ZeRO-3's zero.Init leaves on the weights it partitioned
    with pytest.raises(ValueError, match=r"partitioned by DeepSpeed ZeRO-3 as it loaded.*pass it as `ref_model`"):
        prepare_models(policy, None, value_model, [reward_model])


@pytest.mark.parametrize(
    "returned, message",
    [
        (0.5, r"returned float 0.5, not a list"),
        (None, r"returned NoneType None, not a list"),
        ({"score": 1.0}, r"returned dict \{'score': 1.0\}, not a list"),
        ([[1.0]] * 4, r"returned list \[1.0\] at position 0"),
        (["1.0"] * 4, r"returned str '1.0' at position 0"),
    ],
)
def test_a_reward_function_returning_something_else_than_numbers_is_named(returned, message):
    def judge(prompts, completions, **columns):
        return returned

    with pytest.raises(ValueError, match=rf"Reward function 'judge' {message}.*one float \(or None\) per completion"):
        reward_function_scores(judge, "judge", ["p"] * 4, ["c"] * 4, {}, "cpu")
    for fine in ([1, None, 0.5, True], torch.tensor([1.0, 2.0, 3.0, 4.0]), (torch.tensor(1.0),) * 4):
        scores, present = reward_function_scores(lambda **kw: fine, "fine", ["p"] * 4, ["c"] * 4, {}, "cpu")
        assert scores.shape == (4,) and present.shape == (4,)


def test_a_reward_or_value_model_with_several_outputs_is_refused(make_config, tokenizer, load_models):
    from transformers import AutoModelForSequenceClassification

    config = tiny_config("gpt_neox", tokenizer)
    config.num_labels = 2
    two_labels = AutoModelForSequenceClassification.from_config(config)
    for role, name in (("reward model", "reward_model"), ("value model", "value_model")):
        with pytest.raises(ValueError, match=rf"The {role} .* has a `score` head with 2 outputs.*num_labels=1"):
            build(make_config, tokenizer, load_models, None, make_config(total_episodes=8), **{name: two_labels})


def test_a_policy_that_is_not_a_causal_lm_is_refused(make_config, tokenizer, load_models, prompt_dataset):
    _, value_model, _ = load_models()
    with pytest.raises(TypeError, match=r"`model` must be a causal language model.*GPTNeoXForSequenceClassification"):
        build(make_config, tokenizer, load_models, prompt_dataset, model=value_model)


def test_token_ids_outside_the_vocabulary_are_refused_in_the_dataset_and_in_step(
    make_config, tokenizer, load_models, prompt_dataset
):
    vocab = len(tokenizer)
    dataset = Dataset.from_dict({"input_ids": [[3, 4, 5]] * 15 + [[3, vocab + 7]]})
    with pytest.raises(ValueError, match=rf"`train_dataset`'s `input_ids`: row 15 holds token id {vocab + 7}"):
        build(make_config, tokenizer, load_models, dataset)
    trainer = build(make_config, tokenizer, load_models, None, make_config(total_episodes=80))
    queries, responses = [torch.tensor([3, 4])] * 8, [torch.tensor([5, 6])] * 7 + [torch.tensor([5, -1])]
    with pytest.raises(ValueError, match=r"`step\(\)`'s `responses`: row 7 holds token id -1"):
        trainer.step(queries, responses, [1.0] * 8)


def test_a_dataset_given_as_a_list_or_dict_says_how_to_wrap_it(make_config, tokenizer, load_models):
    with pytest.raises(TypeError, match=r"`train_dataset` is a list of rows.*Dataset.from_list\(rows\)"):
        build(make_config, tokenizer, load_models, [{"prompt": "the movie was"}] * 16)
    with pytest.raises(TypeError, match=r"`train_dataset` is a dict of columns.*Dataset.from_dict\(columns\)"):
        build(make_config, tokenizer, load_models, {"prompt": ["the movie was"] * 16})


def test_no_tokenizer_is_named_as_such(make_config, load_models, prompt_dataset):
    with pytest.raises(ValueError, match=r"`processing_class` \(the policy's tokenizer\) is None"):
        build(make_config, None, load_models, prompt_dataset)


def _poison_a_weight(trainer):
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    with torch.no_grad():
        policy.gpt_neox.embed_in.weight[3, 0] = float("nan")


# Issue 28.1: `learning_rate=inf`, `weight_decay=inf`, `adam_epsilon=0` trained one update of NaN weights that
# `save_model()` wrote. The config refuses them now; set on the optimizer, `save_model()` must still refuse.
@pytest.mark.parametrize("setting, value", [("lr", float("inf")), ("weight_decay", float("inf")), ("eps", 0.0)])
def test_save_model_refuses_nonfinite_weights_naming_the_tensor(
    setting, value, make_config, tokenizer, load_models, prompt_dataset, tmp_path
):
    config = make_config(total_episodes=8, num_ppo_epochs=1)
    trainer = build(make_config, tokenizer, load_models, prompt_dataset, config)
    for group in trainer.optimizer.param_groups:
        group[setting] = value
    trainer.train()  # one update, one step: its loss was finite
    destination = tmp_path / "model"
    with pytest.raises(FloatingPointError, match=rf"^Not saving the model to {destination}: the weight `policy\..*` "):
        trainer.save_model(str(destination))
    assert not destination.exists()


def test_a_checkpoint_of_nonfinite_weights_is_not_written(make_config, tokenizer, load_models, prompt_dataset):
    from transformers import TrainerCallback

    config = make_config(total_episodes=16, save_strategy="steps", save_steps=1)
    trainer = build(make_config, tokenizer, load_models, prompt_dataset, config)

    class PoisonAtUpdate2(TrainerCallback):  # before the checkpoint of update 2 is written
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                _poison_a_weight(trainer)

    trainer.add_callback(PoisonAtUpdate2())
    output = trainer.args.output_dir
    message = r"^Not writing checkpoint-2: the weight `policy.gpt_neox.embed_in.weight` holds NaN or infinity"
    with pytest.raises(FloatingPointError, match=rf"{message}.*newest: .*checkpoint-1"):
        trainer.train()
    assert sorted(os.listdir(output)) == ["checkpoint-1"]  # nothing of checkpoint-2, not even its staging folder


def test_legacy_save_pretrained_refuses_nonfinite_weights(model_paths, tokenizer, tmp_path):
    from trl_ppo.legacy import AutoModelForCausalLMWithValueHead, PPOConfig
    from trl_ppo.legacy import PPOTrainer as LegacyTrainer

    model = AutoModelForCausalLMWithValueHead.from_pretrained(model_paths["gpt_neox"][0])
    trainer = LegacyTrainer(PPOConfig(batch_size=2, mini_batch_size=2), model, None, tokenizer)
    with torch.no_grad():
        model.v_head.summary.weight[0, 0] = float("inf")
    with pytest.raises(FloatingPointError, match=r"the weight `v_head.summary.weight` holds NaN or infinity"):
        trainer.save_pretrained(str(tmp_path / "legacy"))
    assert not (tmp_path / "legacy").exists()


# Issue 28.8: a non-writable `output_dir` failed after the first checkpoint interval, or after the whole run (and
# under a file, with a bare `NotADirectoryError` from `Trainer`, which creates the folder).
@pytest.mark.parametrize("save_strategy", ["steps", "no"])
def test_an_output_dir_that_cannot_be_written_is_refused_when_the_trainer_is_built(
    save_strategy, make_config, tokenizer, load_models, prompt_dataset, tmp_path
):
    (tmp_path / "a_file").write_text("not a folder")
    output_dir = str(tmp_path / "a_file" / "run")
    config = make_config(output_dir=output_dir, save_strategy=save_strategy, save_steps=1)
    with pytest.raises(ValueError, match=rf"^`output_dir` \({output_dir}\) cannot be written: .*a_file is a file"):
        build(make_config, tokenizer, load_models, prompt_dataset, config)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root may write in any folder")
def test_an_output_dir_in_a_read_only_folder_is_refused(tmp_path):
    from trl_ppo.saving import check_writable

    (tmp_path / "read_only").mkdir(mode=0o555)
    with pytest.raises(ValueError, match="may not write in"):
        check_writable(str(tmp_path / "read_only" / "run"))


def test_checking_an_output_dir_creates_no_folder(tmp_path):
    from trl_ppo.saving import check_writable

    check_writable(str(tmp_path / "new" / "run"))
    assert not (tmp_path / "new").exists()

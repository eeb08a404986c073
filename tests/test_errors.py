"""Bad input fails before any rollout with an error naming the argument, the value and the fix; problems that
only show during training name the reward or the update."""

import logging

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from trl_ppo import PPOTrainer


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
        (short_reward, r"Update 1: Reward function 'short_reward' returned 1 scores for 8 completions"),
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
        check_supported(config, deepspeed_enabled=True, fsdp_enabled=False)
    check_supported(config, deepspeed_enabled=False, fsdp_enabled=False)  # both work without DeepSpeed
    check_supported(make_config(), deepspeed_enabled=True, fsdp_enabled=False)
    with pytest.raises(ValueError, match=r"FSDP is not supported.*deepspeed_zero3\.yaml"):
        check_supported(make_config(), deepspeed_enabled=False, fsdp_enabled=True)
    with pytest.raises(ValueError, match=r"ZeRO-3 the reference cannot share layers.*num_shared_layers=None"):
        check_supported(make_config(), deepspeed_enabled=True, fsdp_enabled=False, zero_stage=3, shared_reference=True)
    check_supported(make_config(), deepspeed_enabled=True, fsdp_enabled=False, zero_stage=2, shared_reference=True)


def test_no_reference_can_be_copied_from_a_policy_partitioned_at_load(load_models):
    from trl_ppo.models import prepare_models

    policy, value_model, reward_model = load_models()
    for parameter in policy.parameters():
        parameter.ds_id = 0  # what DeepSpeed ZeRO-3's zero.Init leaves on the weights it partitioned
    with pytest.raises(ValueError, match=r"partitioned by DeepSpeed ZeRO-3 as it loaded.*pass it as `ref_model`"):
        prepare_models(policy, None, value_model, [reward_model])

"""The trainer end to end on tiny models: the PPO sanity check, weights that move, PEFT, logs, saving, learning."""

import math

import pytest
import torch
from conftest import build_trainer
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from trl_ppo import PPOTrainer, ppo
from trl_ppo.rewards import reward_model_scores

# 16 episodes of up to 32 tokens at a high temperature: with a ~140-word vocabulary some responses stop at EOS.
EOS_LIKELY = dict(
    response_length=32, temperature=3.0, per_device_train_batch_size=8, local_rollout_forward_batch_size=8
)

PPO_METRICS = (
    "eps",
    "objective/kl",
    "objective/entropy",
    "objective/non_score_reward",
    "objective/rlhf_reward",
    "objective/scores",
    "policy/approxkl_avg",
    "policy/clipfrac_avg",
    "loss/policy_avg",
    "loss/value_avg",
    "val/clipfrac_avg",
    "policy/entropy_avg",
    "val/ratio",
    "val/ratio_var",
    "val/num_eos_tokens",
    "grad_norm",
    "lr",
    "episode",
)


def one_rollout(trainer):
    batch = next(iter(trainer.train_dataloader))
    rollout = trainer.collect_rollout(batch)
    rollout.scores, _ = trainer.score(rollout, batch)
    return rollout


@pytest.mark.parametrize("arch", ["gpt_neox", "llama", "qwen2"])
def test_first_minibatch_ratio_is_one(arch, make_config, tokenizer, load_models, prompt_dataset):
    """Before the first optimizer step the trained policy is the sampling policy: ratio 1, approx-KL 0, no
    clipping. Catches temperature, padding, position-id or dropout differences between sampling and training
    (the models are saved with dropout 0.1 and prompts are left-padded to different lengths)."""
    config = make_config(learning_rate=5e-2, num_ppo_epochs=2, temperature=0.7)
    trainer = build_trainer(config, tokenizer, load_models, prompt_dataset, arch=arch)
    rollout = one_rollout(trainer)
    assert rollout.query_mask.sum(1).unique().numel() > 1  # prompts of different lengths
    advantages = trainer.compute_advantages(rollout, trainer.compute_rewards(rollout))
    stats = trainer.ppo_update(rollout, advantages).stats
    micro_batches_per_step = config.local_mini_batch_size // config.per_device_train_batch_size
    first = slice(0, micro_batches_per_step)  # the first minibatch of the first epoch
    torch.testing.assert_close(stats["val/ratio"][first], torch.ones(micro_batches_per_step), atol=1e-5, rtol=0)
    assert stats["policy/approxkl_avg"][first].max() < 1e-9
    assert stats["policy/clipfrac_avg"][first].max() == 0
    # The check can fail: after a step with a large learning rate the ratio moves away from 1.
    assert (stats["val/ratio"][micro_batches_per_step:] - 1).abs().max() > 1e-3


def test_rollout_truncates_after_the_stop_token(make_config, tokenizer, load_models, prompt_dataset):
    config = make_config(stop_token="eos", **EOS_LIKELY)
    trainer = build_trainer(config, tokenizer, load_models, prompt_dataset)
    rollout = one_rollout(trainer)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert (rollout.responses == eos).any(), "the high temperature should produce some EOS tokens"
    for response, mask in zip(rollout.responses.tolist(), rollout.response_mask.tolist()):
        if eos in response:
            stop = response.index(eos)
            assert mask == [True] * (stop + 1) + [False] * (len(response) - stop - 1)
            assert response[stop + 1 :] == [pad] * (len(response) - stop - 1)
        else:
            assert all(mask)
    assert (rollout.logprobs[~rollout.response_mask] == ppo.INVALID_LOGPROB).all()
    assert (rollout.values[~rollout.response_mask] == 0).all()


def test_reward_model_is_read_at_the_last_response_token(make_config, tokenizer, load_models, prompt_dataset):
    """The score of a padded episode equals the reward model's output on the same tokens without padding."""
    config = make_config(stop_token="eos", **EOS_LIKELY)
    trainer = build_trainer(config, tokenizer, load_models, prompt_dataset)
    rollout = one_rollout(trainer)
    reward_model = trainer.reward_model
    scores = reward_model_scores(reward_model, rollout, chunk_size=3)
    for i in range(rollout.queries.size(0)):
        tokens = torch.cat([rollout.queries[i][rollout.query_mask[i]], rollout.responses[i][rollout.response_mask[i]]])
        with torch.no_grad():
            alone = reward_model(input_ids=tokens.unsqueeze(0)).logits.squeeze()
        torch.testing.assert_close(scores[i], alone, atol=1e-4, rtol=0)


def test_two_updates_train_policy_and_value_and_log_every_metric(make_config, tokenizer, load_models, prompt_dataset):
    config = make_config(total_episodes=16)  # batch 8 -> two updates
    trainer = build_trainer(config, tokenizer, load_models, prompt_dataset)
    wrapper = trainer.accelerator.unwrap_model(trainer.model)
    before_policy = {k: v.clone() for k, v in wrapper.policy.state_dict().items()}
    before_value = {k: v.clone() for k, v in wrapper.value_model.state_dict().items()}
    output = trainer.train()
    assert output.global_step == 2 and trainer.state.episode == 16
    assert any(not torch.equal(before_policy[k], v) for k, v in wrapper.policy.state_dict().items())
    assert any(not torch.equal(before_value[k], v) for k, v in wrapper.value_model.state_dict().items())
    ref = trainer.ref_model.state_dict()
    assert all(torch.equal(before_policy[k], ref[k]) for k in ref), "the reference must stay frozen"
    logs = [entry for entry in trainer.state.log_history if "objective/scores" in entry]
    assert len(logs) == 2
    for name in PPO_METRICS:
        assert all(math.isfinite(entry[name]) for entry in logs), name
    assert logs[-1]["episode"] == 16
    assert all(entry["val/explained_variance"] <= 1 for entry in logs)  # the critic's, one turn: no per-turn names
    assert not any(key.startswith("val/explained_variance/") for entry in logs for key in entry)


def test_peft_trains_only_the_adapter_without_a_ref_model(make_config, tokenizer, load_models, prompt_dataset):
    from peft import LoraConfig

    config = make_config(total_episodes=8, learning_rate=1e-2)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["query_key_value"], task_type="CAUSAL_LM")
    trainer = build_trainer(config, tokenizer, load_models, prompt_dataset, peft_config=peft_config)
    assert trainer.ref_model is None
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    trainer.train()
    changed = {k for k, v in policy.state_dict().items() if not torch.equal(before[k], v)}
    assert changed and all("lora_" in k for k in changed), changed
    trainer.save_model(config.output_dir)
    from peft import AutoPeftModelForCausalLM

    assert AutoPeftModelForCausalLM.from_pretrained(config.output_dir) is not None


def test_save_model_writes_a_loadable_policy_and_optionally_the_value_model(
    make_config, tokenizer, load_models, prompt_dataset, tmp_path
):
    config = make_config(total_episodes=8, save_value_model=True)
    trainer = build_trainer(config, tokenizer, load_models, prompt_dataset)
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    trained = trainer.accelerator.unwrap_model(trainer.model).policy
    for key, value in trained.state_dict().items():
        torch.testing.assert_close(policy.state_dict()[key], value)
    value_model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "saved" / "value_model")
    assert value_model.config.num_labels == 1
    assert (tmp_path / "saved" / "tokenizer.json").exists()


def test_checkpoints_follow_save_steps(make_config, tokenizer, load_models, prompt_dataset):
    config = make_config(total_episodes=16, save_strategy="steps", save_steps=1)
    trainer = build_trainer(config, tokenizer, load_models, prompt_dataset)
    trainer.train()
    from pathlib import Path

    out = Path(config.output_dir)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert (out / "checkpoint-2" / "model.safetensors").exists()
    assert (out / "checkpoint-2" / "value_model" / "model.safetensors").exists()
    assert (out / "checkpoint-2" / "trainer_state.json").exists()


def test_gradient_checkpointing_and_bf16_are_honoured(make_config, tokenizer, load_models, prompt_dataset):
    config = make_config(total_episodes=8, gradient_checkpointing=True, bf16=True, use_cpu=True)
    trainer = build_trainer(config, tokenizer, load_models, prompt_dataset)
    assert trainer.accelerator.mixed_precision == "bf16"
    wrapper = trainer.accelerator.unwrap_model(trainer.model)
    assert wrapper.policy.is_gradient_checkpointing and wrapper.value_model.is_gradient_checkpointing
    seen = []
    hook = wrapper.policy.get_output_embeddings().register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    trainer.train()
    hook.remove()
    assert torch.bfloat16 in seen
    assert all(math.isfinite(v) for v in trainer.state.log_history[-1].values() if isinstance(v, float))


@pytest.mark.parametrize(
    "value_model", [pytest.param("separate", marks=pytest.mark.slow), None], ids=["value_model", "value_head"]
)  # the quick loop learns with the value head; make test with a separate value model too
def test_learning_with_a_reward_that_favours_one_token(
    value_model, make_config, tokenizer, load_models, prompt_dataset
):
    """With +1 per 'good' in the completion, the mean score of the last updates clearly beats the first. With the
    policy's own value head, a rule-based reward alone trains: no sequence-classification model anywhere."""

    def count_good(prompts, completions, **columns):
        return [float(text.split().count("good")) for text in completions]

    config = make_config(
        total_episodes=30 * 16,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        local_rollout_forward_batch_size=16,
        response_length=8,
        temperature=1.0,
        learning_rate=3e-3,
        num_ppo_epochs=4,
        kl_coef=0.01,
        seed=7,
    )
    trainer = build_trainer(config, tokenizer, load_models, prompt_dataset, reward=count_good, value_model=value_model)
    trainer.train()
    scores = [entry["objective/scores"] for entry in trainer.state.log_history if "objective/scores" in entry]
    assert len(scores) == 30
    first, last = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    print("first/last mean score", first, last)
    assert last > first + 1.0, (first, last)


def test_missing_eos_penalty_looks_for_the_configured_stop_token(make_config, tokenizer, load_models, prompt_dataset):
    """With `stop_token_id` set to a word, the penalty hits responses without that word, not those without EOS."""
    good = tokenizer.convert_tokens_to_ids("good")
    config = make_config(stop_token_id=good, missing_eos_penalty=2.0, **EOS_LIKELY)
    trainer = build_trainer(
        config,
        tokenizer,
        load_models,
        prompt_dataset,
        reward=lambda prompts, completions, **_: [0.0] * len(completions),
    )
    rollout = one_rollout(trainer)
    has_good = ((rollout.responses == good) & rollout.response_mask).any(1)
    assert has_good.any() and (~has_good).any()
    assert rollout.scores.tolist() == [0.0 if h else -2.0 for h in has_good.tolist()]
    has_eos = ((rollout.responses == tokenizer.eos_token_id) & rollout.response_mask).any(1)
    assert (has_eos & ~has_good).any()  # an EOS does not spare a response without the stop token


def test_reward_functions_get_text_and_dataset_columns(make_config, tokenizer, load_models, prompt_dataset):
    seen = {}

    def reward(prompts, completions, topic, **columns):
        seen.update(prompts=prompts, completions=completions, topic=topic, other=columns)
        return [float(len(c.split())) for c in completions]

    dataset = prompt_dataset.add_column("topic", [f"t{i}" for i in range(len(prompt_dataset))])
    trainer = build_trainer(make_config(), tokenizer, load_models, dataset, reward=reward)
    rollout = one_rollout(trainer)
    assert len(seen["prompts"]) == len(seen["completions"]) == len(seen["topic"]) == 8
    assert all(t.startswith("t") for t in seen["topic"]) and "prompt" in seen["other"]
    assert seen["prompts"] == seen["other"]["prompt"]  # decoded prompts round-trip the text column
    assert rollout.scores.tolist() == [float(len(c.split())) for c in seen["completions"]]


def test_conversational_prompts_use_the_chat_template(make_config, tokenizer, load_models):
    from datasets import Dataset

    messages = [[{"role": "user", "content": "the movie was"}]] * 16
    trainer = build_trainer(
        make_config(total_episodes=8), tokenizer, load_models, Dataset.from_dict({"prompt": messages})
    )
    expected = tokenizer.apply_chat_template(messages[0], add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(trainer.train_dataset[0]["input_ids"]) == expected.strip()
    trainer.train()


def test_saved_policy_keeps_its_kv_cache_setting(make_config, tokenizer, load_models, prompt_dataset, tmp_path):
    trainer = build_trainer(make_config(total_episodes=8), tokenizer, load_models, prompt_dataset)
    trainer.save_model(str(tmp_path / "saved"))
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "saved").config.use_cache is True


def test_logging_steps_average_updates_and_the_schedule_steps_once_per_update(
    make_config, tokenizer, load_models, prompt_dataset, monkeypatch
):
    from transformers import TrainerCallback

    from trl_ppo.metrics import MetricsSinceLog

    class Recorder(TrainerCallback):
        def __init__(self):
            self.step_ends, self.logs = 0, []

        def on_step_end(self, args, state, control, **kwargs):
            self.step_ends += 1

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs))

    recorder = Recorder()
    config = make_config(total_episodes=32, logging_steps=2, learning_rate=1e-3, lr_scheduler_type="linear")
    trainer = build_trainer(config, tokenizer, load_models, prompt_dataset, callbacks=[recorder])
    per_update = []
    original_add = MetricsSinceLog.add
    monkeypatch.setattr(MetricsSinceLog, "add", lambda self, m: per_update.append(dict(m)) or original_add(self, m))
    trainer.train()
    assert recorder.step_ends == 4 and len(per_update) == 4
    assert [entry["episode"] for entry in recorder.logs] == [16, 32]  # updates 2 and 4
    for log, pair in zip(recorder.logs, (per_update[:2], per_update[2:])):
        assert log["objective/scores"] == pytest.approx(sum(m["objective/scores"] for m in pair) / 2)
        assert log["lr"] == pair[1]["lr"]
    # Linear decay over 4 updates, one scheduler step per update: lr before update k is 1e-3 * (4 - k + 1) / 4.
    assert [m["lr"] for m in per_update] == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4])


def test_pad_token_equal_to_eos_keeps_the_stop_token_in_the_response(
    make_config, tokenizer, load_models, prompt_dataset
):
    """The common `tokenizer.pad_token = tokenizer.eos_token` set-up: the EOS that ends a response is part of it
    (the reward model reads it, GAE credits it), and the first PPO ratio is still exactly 1."""
    import copy

    same = copy.deepcopy(tokenizer)
    same.pad_token = same.eos_token
    config = make_config(stop_token="eos", **EOS_LIKELY)
    trainer = build_trainer(config, same, load_models, prompt_dataset)
    rollout = one_rollout(trainer)
    eos = same.eos_token_id
    ends_with_eos = [(r[m][-1] == eos).item() for r, m in zip(rollout.responses, rollout.response_mask)]
    assert any(ends_with_eos)
    for response, mask, stopped in zip(rollout.responses, rollout.response_mask, ends_with_eos):
        if stopped:
            assert (response[mask] == eos).sum() == 1  # the EOS is inside the mask exactly once
    advantages = trainer.compute_advantages(rollout, trainer.compute_rewards(rollout))
    stats = trainer.ppo_update(rollout, advantages).stats
    torch.testing.assert_close(stats["val/ratio"][:2], torch.ones(2), atol=1e-5, rtol=0)


def test_right_padded_prompts_are_rejected(make_config, tokenizer, load_models, prompt_dataset):
    import copy

    from transformers import DataCollatorWithPadding

    right = copy.deepcopy(tokenizer)
    right.padding_side = "right"
    dataset = prompt_dataset.map(
        lambda row: {"input_ids": tokenizer(row["prompt"])["input_ids"]}, remove_columns=["prompt"]
    )
    with pytest.raises(ValueError, match="left-padded"):
        build_trainer(make_config(), tokenizer, load_models, dataset, data_collator=DataCollatorWithPadding(right))


def test_ref_adapter_name_selects_the_reference_adapter(make_config, tokenizer, load_models, prompt_dataset):
    from peft import LoraConfig, get_peft_model

    policy, value_model, reward_model = load_models()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["query_key_value"], task_type="CAUSAL_LM")
    policy = get_peft_model(policy, lora, adapter_name="default")
    policy.add_adapter("ref", lora)
    with torch.no_grad():  # make the reference adapter differ from the (identity-initialised) trained one
        for name, parameter in policy.named_parameters():
            if "lora_B.ref" in name:
                parameter.normal_(std=0.5)
    config = make_config(ref_adapter_name="ref", model_adapter_name="default")
    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=None,
        reward_model=reward_model,
        train_dataset=prompt_dataset,
        value_model=value_model,
    )
    rollout = one_rollout(trainer)
    assert policy.active_adapter == "default"  # switched back after computing ref_logprobs
    mask = rollout.response_mask
    assert (rollout.ref_logprobs - rollout.logprobs)[mask].abs().max() > 1e-3
    policy.set_adapter("ref")
    from trl_ppo.logprobs import response_logprobs
    from trl_ppo.rollout import masked_response_logprobs

    with torch.no_grad():  # the plain forward (chunk_size 0) against the trainer's chunked one, through PEFT
        inputs = (rollout.input_ids, rollout.attention_mask, rollout.responses, config.temperature)
        output = response_logprobs(policy, *inputs)
    expected = masked_response_logprobs(output.logprobs, rollout)
    assert config.logprobs_chunk_size > 0
    torch.testing.assert_close(expected, rollout.ref_logprobs, atol=1e-5, rtol=0)
    policy.set_adapter("default")
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all(".default" in n for n in trainable)

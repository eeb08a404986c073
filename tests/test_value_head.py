"""`value_model=None`: the policy's own value head (`AutoModelForCausalLMWithValueHead`), trained, saved and loaded."""

import pytest
import torch
from conftest import build_trainer
from transformers import AutoModelForCausalLM

from trl_ppo import AutoModelForCausalLMWithValueHead, PPOTrainer
from trl_ppo.value_head import VALUE_HEAD_FILE


def count_good(prompts, completions, **columns):
    return [float(text.split().count("good")) for text in completions]


def test_value_head_outputs_match_the_lm_and_read_its_last_hidden_state(load_models):
    policy, _, _ = load_models()
    model = AutoModelForCausalLMWithValueHead.from_pretrained(policy)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        output = model(input_ids=ids, logits_to_keep=3)
        plain = policy(input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(output.logits, plain.logits[:, -3:])
    expected = plain.hidden_states[-1][:, -3:] @ model.v_head.summary.weight[0] + model.v_head.summary.bias
    torch.testing.assert_close(output.value, expected)
    assert output.value.shape == (1, 3)


def test_shared_head_trains_saves_and_loads_with_the_head_intact(
    make_config, tokenizer, load_models, prompt_dataset, tmp_path
):
    trainer = build_trainer(make_config(), tokenizer, load_models, prompt_dataset, reward=count_good, value_model=None)
    model = trainer.accelerator.unwrap_model(trainer.model).policy
    assert isinstance(model, AutoModelForCausalLMWithValueHead)
    head_before = model.v_head.summary.weight.clone()
    lm_before = model.pretrained_model.get_input_embeddings().weight.clone()
    trainer.train()
    assert not torch.equal(model.v_head.summary.weight, head_before)  # the value loss trains the head
    assert not torch.equal(model.pretrained_model.get_input_embeddings().weight, lm_before)
    assert all(k in trainer.state.log_history[0] for k in ("loss/value_avg", "val/clipfrac_avg"))

    trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / VALUE_HEAD_FILE).is_file()
    assert not (tmp_path / "saved" / "value_model").exists()
    loaded = AutoModelForCausalLMWithValueHead.from_pretrained(tmp_path / "saved")
    assert torch.equal(loaded.v_head.summary.weight, model.v_head.summary.weight)
    assert torch.equal(loaded.v_head.summary.bias, model.v_head.summary.bias)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")  # the policy alone, for inference
    for name, value in plain.state_dict().items():
        assert torch.equal(value, model.pretrained_model.state_dict()[name]), name


def test_shared_head_holds_fewer_parameters_than_a_separate_value_model(
    make_config, tokenizer, load_models, prompt_dataset
):
    """The memory that a separate value model costs: a second backbone. With the shared head the trained module
    is the policy plus hidden_size + 1 parameters."""

    def trained_parameters(trainer):
        return sum(p.numel() for p in trainer.model.parameters())

    shared = build_trainer(make_config(), tokenizer, load_models, prompt_dataset, reward=count_good, value_model=None)
    separate = build_trainer(make_config(), tokenizer, load_models, prompt_dataset, reward=count_good)
    policy_size = sum(p.numel() for p in load_models()[0].parameters())
    hidden = load_models()[0].config.hidden_size
    assert trained_parameters(shared) == policy_size + hidden + 1
    assert trained_parameters(separate) > policy_size + policy_size // 2
    assert trained_parameters(shared) < trained_parameters(separate)


def test_shared_head_with_peft_trains_the_adapter_and_the_head(make_config, tokenizer, load_models, prompt_dataset):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["query_key_value"], task_type="CAUSAL_LM")
    trainer = build_trainer(
        make_config(), tokenizer, load_models, prompt_dataset, reward=count_good, value_model=None, peft_config=lora
    )
    model = trainer.accelerator.unwrap_model(trainer.model).policy
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name or name.startswith("v_head.") for name in trainable)
    assert any(name.startswith("v_head.") for name in trainable)
    head_before = model.v_head.summary.weight.clone()
    trainer.train()
    assert not torch.equal(model.v_head.summary.weight, head_before)


def test_a_value_head_policy_with_a_separate_value_model_is_rejected(
    make_config, tokenizer, load_models, prompt_dataset
):
    policy, value_model, _ = load_models()
    with pytest.raises(ValueError, match=r"has a value head and a separate `value_model`"):
        PPOTrainer(
            args=make_config(),
            processing_class=tokenizer,
            model=AutoModelForCausalLMWithValueHead.from_pretrained(policy),
            ref_model=None,
            reward_model=count_good,
            train_dataset=prompt_dataset,
            value_model=value_model,
        )


def test_the_added_value_head_starts_at_zero_and_still_learns(make_config, tokenizer, load_models, prompt_dataset):
    """By default (`value_head_init="zeros"`) the added head's values are 0 everywhere before training, and the
    value loss still moves it (its gradient is the hidden state times the error); `"normal"` draws the weights."""
    trainer = build_trainer(make_config(), tokenizer, load_models, prompt_dataset, reward=count_good, value_model=None)
    model = trainer.accelerator.unwrap_model(trainer.model).policy
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(model(input_ids=ids).value, torch.zeros(1, 4))
    config = make_config(value_head_init="normal")
    drawn = build_trainer(config, tokenizer, load_models, prompt_dataset, reward=count_good, value_model=None)
    assert trainer.accelerator.unwrap_model(drawn.model).policy(input_ids=ids).value.abs().min() > 0
    trainer.train()
    assert model.v_head.summary.weight.abs().sum() > 0


def test_value_head_reset_parameters_zeros_normal_and_unknown():
    from trl_ppo.value_head import ValueHead

    head = ValueHead(8)
    head.reset_parameters("zeros")
    assert not head.summary.weight.any() and not head.summary.bias.any()
    head.reset_parameters("normal")
    assert head.summary.weight.abs().min() > 0 and not head.summary.bias.any()
    with pytest.raises(ValueError, match="Unknown value head init 'uniform'"):
        head.reset_parameters("uniform")

"""`trl_ppo.legacy`: inputs that trl 0.11 scripts can give and that used to fail late, silently or after the update
was applied, and the trl 0.11 surfaces that scripts read (`state_dict()` keys, a pad token set after construction,
`reward_adapter`). Tiny offline models, as in test_legacy.py (whose fixtures and helpers are reused)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_legacy import (  # noqa: F401  (fixtures: used by name)
    _one_thread,
    _run_in_tmp_path,
    config_for,
    episodes,
    gpt2_path,
    load_vhead,
    scores_of,
    snapshot,
)

from trl_ppo.legacy import AutoModelForCausalLMWithValueHead, PPOTrainer


def trainer_of(gpt2_path, tokenizer, **overrides):
    return PPOTrainer(config_for(**overrides), load_vhead(gpt2_path), None, tokenizer)


def unchanged(before, model):
    return all(torch.equal(value, dict(model.named_parameters())[name]) for name, value in before.items())


# ----------------------------------------------------------------------------------------------------------------
# errors before anything is written or trained


def test_save_pretrained_into_an_existing_file_is_refused(gpt2_path, tokenizer, tmp_path):
    trainer = trainer_of(gpt2_path, tokenizer)
    target = tmp_path / "weights.bin"
    target.write_bytes(b"mine")
    for save in (trainer.save_pretrained, trainer.model.save_pretrained):
        with pytest.raises(NotADirectoryError, match=r"weights\.bin'.* existing file.*folder"):
            save(str(target))
    assert target.read_bytes() == b"mine"


def test_step_with_no_variance_in_the_returns_counts_once_and_reports_nan(gpt2_path, tokenizer):
    """batch_size 1 with a one-token response: the returns have no variance, so `ppo/val/var_explained` is
    undefined. It was a ZeroDivisionError raised after the update was applied and counted."""
    trainer = trainer_of(gpt2_path, tokenizer, batch_size=1, mini_batch_size=1)
    queries, responses = episodes(tokenizer, [3], [1])
    before = snapshot(trainer.model)
    stats = trainer.step(queries, responses, scores_of(1.0))
    assert math.isnan(stats["ppo/val/var_explained"])
    assert math.isfinite(stats["ppo/loss/total"]) and stats["ppo/returns/var"] == 0.0
    assert not unchanged(before, trainer.model)
    assert trainer.trainer.state.global_step == 1
    trainer.step(queries, responses, scores_of(0.0))
    assert trainer.trainer.state.global_step == 2


def test_all_zero_response_masks_are_refused_before_the_update(gpt2_path, tokenizer):
    trainer = trainer_of(gpt2_path, tokenizer)
    queries, responses = episodes(tokenizer, [3, 2], [3, 2])
    before = snapshot(trainer.model)
    with pytest.raises(ValueError, match=r"`response_masks` are all zeros"):
        trainer.step(queries, responses, scores_of(1.0, 0.0), response_masks=[torch.zeros(3), torch.zeros(2)])
    assert unchanged(before, trainer.model) and trainer.trainer.state.global_step == 0
    trainer.step(queries, responses, scores_of(1.0, 0.0), response_masks=[torch.zeros(3), torch.ones(2)])


def test_scores_with_gradients_are_detached(gpt2_path, tokenizer):
    """Scores from a trainable head: two minibatches used to fail with "backward through the graph a second time",
    and the PPO loss's gradient reached the head."""
    trainer = trainer_of(gpt2_path, tokenizer, batch_size=2, mini_batch_size=1)
    queries, responses = episodes(tokenizer, [3, 4], [4, 3])
    head = torch.nn.Linear(3, 1)
    scores = [head(q[:3].float()).squeeze() for q in queries]
    assert all(score.requires_grad for score in scores)
    stats = trainer.step(queries, responses, scores)
    assert math.isfinite(stats["ppo/loss/total"])
    assert head.weight.grad is None and head.bias.grad is None


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(batch_size=-1), r"`batch_size` .* must be a positive integer, got -1"),
        (dict(batch_size=0), r"`batch_size` .* must be a positive integer, got 0"),
        (dict(max_new_tokens=0), r"`max_new_tokens` must be a positive integer .* got 0"),
        (dict(max_new_tokens=-1), r"`max_new_tokens` must be a positive integer .* got -1"),
        (dict(max_new_tokens=10**6), r"longest query \(4 tokens\) and `max_new_tokens` \(1000000\) exceed the model's "
         r"context \(128 positions\): lower it to at most 124"),
        (dict(max_new_tokens=2.5), r"`max_new_tokens` must be a positive integer .* got 2.5"),
    ],
)
def test_generate_refuses_bad_options_before_sampling(options, message, gpt2_path, tokenizer):
    trainer = trainer_of(gpt2_path, tokenizer)
    queries, _ = episodes(tokenizer, [4, 2], [1, 1])
    rng = torch.get_rng_state()
    with pytest.raises(ValueError, match=message):
        trainer.generate(queries, return_prompt=False, **options)
    assert torch.equal(rng, torch.get_rng_state())  # nothing was sampled


def test_generate_refuses_query_ids_outside_the_vocabulary(gpt2_path, tokenizer):
    trainer = trainer_of(gpt2_path, tokenizer)
    for bad in (len(tokenizer) + 3, -1):
        with pytest.raises(ValueError, match=rf"`query_tensor`: row 1 holds token id {bad}, outside the policy"):
            trainer.generate([torch.tensor([5, 6]), torch.tensor([5, bad])])


def test_step_refuses_episodes_longer_than_the_context(gpt2_path, tokenizer):
    trainer = trainer_of(gpt2_path, tokenizer)
    queries, responses = episodes(tokenizer, [100, 3], [29, 2])
    before = snapshot(trainer.model)
    with pytest.raises(ValueError, match=r"episode 0 has 100 query and 29 response tokens, 129 in all, more than the "
                       r"model's context \(128 positions\)"):
        trainer.step(queries, responses, scores_of(1.0, 0.0))
    assert unchanged(before, trainer.model) and trainer.trainer.state.global_step == 0
    queries, responses = episodes(tokenizer, [100, 3], [28, 2])  # exactly the context
    trainer.step(queries, responses, scores_of(1.0, 0.0))


# ----------------------------------------------------------------------------------------------------------------
# trl 0.11 behaviour that scripts rely on


def test_kl_coefficient_set_before_the_first_step_is_used(gpt2_path, tokenizer):
    trainer = trainer_of(gpt2_path, tokenizer)
    trainer.kl_ctl.value = 0.7
    queries, responses = episodes(tokenizer, [3, 2], [3, 2])
    stats = trainer.step(queries, responses, scores_of(1.0, 0.0))
    assert stats["objective/kl_coef"] == pytest.approx(0.7)
    trainer.kl_ctl.value = 0.05
    stats = trainer.step(queries, responses, scores_of(1.0, 0.0))
    assert stats["objective/kl_coef"] == pytest.approx(0.05)


def test_log_stats_refuses_rewards_of_another_length(gpt2_path, tokenizer):
    trainer = trainer_of(gpt2_path, tokenizer)
    queries, responses = episodes(tokenizer, [3, 2], [3, 2])
    stats = trainer.step(queries, responses, scores_of(1.0, 0.0))
    batch = {"query": ["a", "b"], "response": ["c", "d"]}
    with pytest.raises(ValueError, match=r"`log_stats` got 3 rewards, but `batch\['query'\]` has 2"):
        trainer.log_stats(stats, batch, scores_of(1.0, 0.0, 1.0))
    with pytest.raises(ValueError, match=r"`log_stats` got 1 rewards, but `batch_size` has 2"):
        trainer.log_stats(stats, {}, scores_of(1.0))
    trainer.log_stats(stats, batch, scores_of(1.0, 0.0))


def test_state_dict_has_trl_0_11_keys_and_loads_back_in_either_layout(gpt2_path):
    model = load_vhead(gpt2_path)
    state = model.state_dict()
    assert torch.equal(state["transformer.wte.weight"], model.pretrained_model.transformer.wte.weight)
    assert {"v_head.summary.weight", "v_head.summary.bias"} <= set(state)
    assert not [key for key in state if key.startswith("pretrained_model.")]
    assert set(state) == set(model.pretrained_model.state_dict()) | {"v_head.summary.weight", "v_head.summary.bias"}

    other = load_vhead(gpt2_path)
    with torch.no_grad():
        other.v_head.summary.weight.zero_()
        other.pretrained_model.transformer.wte.weight.zero_()
    assert str(other.load_state_dict(state)) == "<All keys matched successfully>"
    assert torch.equal(other.v_head.summary.weight, model.v_head.summary.weight)
    assert torch.equal(other.pretrained_model.transformer.wte.weight, model.pretrained_model.transformer.wte.weight)
    modules_state = torch.nn.Module.state_dict(model)  # nn.Module's names (`pretrained_model.*`) load too
    assert "pretrained_model.transformer.wte.weight" in modules_state
    copy.deepcopy(other).load_state_dict(modules_state)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        other.load_state_dict({**state, "bogus.weight": torch.zeros(1)})

    class Holder(torch.nn.Module):  # inside another module (the trainer's wrapper) the prefix is kept
        def __init__(self, inner):
            super().__init__()
            self.policy = inner

    assert "policy.transformer.wte.weight" in Holder(model).state_dict()
    Holder(other).load_state_dict(Holder(model).state_dict())


def test_a_pad_token_set_after_the_trainer_is_made_is_accepted(gpt2_path, tokenizer):
    """GPT-2's tokenizer has no pad token; trl 0.11 scripts set `pad_token = eos_token` after making the trainer."""
    no_pad = copy.deepcopy(tokenizer)
    no_pad.pad_token = None
    trainer = PPOTrainer(config_for(), load_vhead(gpt2_path), None, no_pad)
    queries, responses = episodes(tokenizer, [3, 2], [3, 2])
    with pytest.raises(ValueError, match=r"no pad token, which `generate\(\)` .* needs.*pad_token = tokenizer"):
        trainer.generate(queries)
    with pytest.raises(ValueError, match=r"no pad token, which `step\(\)` .* needs"):
        trainer.step(queries, responses, scores_of(1.0, 0.0))
    assert trainer.trainer.state.global_step == 0
    no_pad.pad_token = no_pad.eos_token
    responses = trainer.generate(queries, return_prompt=False, max_new_tokens=3)
    trainer.step(queries, responses, scores_of(1.0, 0.0))
    assert trainer.trainer.state.global_step == 1


# ----------------------------------------------------------------------------------------------------------------
# reward_adapter: trl 0.11's multi-adapter RL (its test_ppo_trainer.py's case, on the tiny GPT-2)


def reward_adapter_folder(gpt2_path, folder):
    """A LoRA reward model (sequence classification, `score` head) trained one step and saved as trl 0.11's users
    made them -> its logits on fixed inputs, before and after that step."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    reward_model = AutoModelForSequenceClassification.from_pretrained(gpt2_path, num_labels=1)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="SEQ_CLS")
    reward_model = get_peft_model(reward_model, config)
    inputs = torch.tensor([[10, 11, 12, 13], [14, 15, 16, 17]])
    before = reward_model(inputs).logits.detach()
    optimizer = torch.optim.Adam([p for p in reward_model.parameters() if p.requires_grad], lr=1e-2)
    reward_model(inputs).logits.mean().backward()
    optimizer.step()
    reward_model.eval()
    after = reward_model(inputs).logits.detach()
    reward_model.save_pretrained(folder)
    return inputs, before, after


@pytest.mark.parametrize("peft_before_0_19", [False, True])
def test_reward_adapter_scores_on_the_policy_backbone_and_stays_frozen(
    gpt2_path, tokenizer, tmp_path, monkeypatch, peft_before_0_19
):
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM

    if peft_before_0_19:  # pyproject admits peft>=0.15; `set_adapter` took no `inference_mode` before 0.19
        newer = PeftModel.set_adapter
        monkeypatch.setattr(PeftModel, "set_adapter", lambda self, adapter_name: newer(self, adapter_name))

    inputs, untrained, trained = reward_adapter_folder(gpt2_path, tmp_path / "rm_adapter")
    assert not torch.allclose(untrained, trained)
    policy_lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM")
    model = AutoModelForCausalLMWithValueHead.from_pretrained(
        gpt2_path, peft_config=policy_lora, reward_adapter=str(tmp_path / "rm_adapter")
    )
    assert model.supports_rm_adapter and model.rm_adapter_name == "reward_adapter"
    backbone = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(gpt2_path).parameters())
    assert sum(p.numel() for p in model.parameters()) < 1.2 * backbone  # one backbone, not two
    reward_weights = {
        name: p.detach().clone() for name, p in model.named_parameters() if "reward" in name or "score" in name
    }
    assert reward_weights and not any(p.requires_grad for n, p in model.named_parameters() if n in reward_weights)

    trainer = PPOTrainer(config_for(), model, None, tokenizer)
    assert trainer.ref_model is None
    queries, responses = episodes(tokenizer, [4, 3], [3, 4])
    for _ in range(2):
        trainer.step(queries, responses, scores_of(1.0, 0.0))
    scores = model.compute_reward_score(inputs)
    assert scores.shape == (2, 4, 1)
    torch.testing.assert_close(scores[:, -1, :], trained, atol=1e-5, rtol=1e-4)  # the reward model, exactly
    assert model.pretrained_model.active_adapter == "default"
    for name, value in model.named_parameters():
        if name in reward_weights:
            assert torch.equal(value, reward_weights[name]) and not value.requires_grad, name
        elif "lora" in name and "default" in name:
            assert value.requires_grad, name  # the policy's adapter still trains


def test_reward_adapter_is_refused_clearly_without_peft_or_a_score_head(gpt2_path, tmp_path):
    with pytest.raises(ValueError, match=r"`reward_adapter` can only be used with a PEFT policy: pass `peft_config`"):
        AutoModelForCausalLMWithValueHead.from_pretrained(gpt2_path, reward_adapter=str(tmp_path))
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM")
    with pytest.raises(ValueError, match=r"holds no adapter weights"):
        AutoModelForCausalLMWithValueHead.from_pretrained(gpt2_path, peft_config=lora, reward_adapter=str(tmp_path))
    with pytest.raises(ValueError, match=r"does not support reward modeling adapter: load it with"):
        load_vhead(gpt2_path).compute_reward_score(torch.tensor([[10, 11]]))


def test_generate_checks_each_length_sampler_draw_against_the_context(gpt2_path, tokenizer):
    trainer = trainer_of(gpt2_path, tokenizer)
    queries, _ = episodes(tokenizer, [120, 2], [1, 1])  # 120 + the default 20 new tokens would not fit
    responses = trainer.generate(queries, return_prompt=False, length_sampler=lambda: 8)
    assert all(1 <= response.numel() <= 8 for response in responses)
    with pytest.raises(ValueError, match=r"`length_sampler\(\)` \(9\) exceed the model's context .* at most 8"):
        trainer.generate(queries, return_prompt=False, length_sampler=lambda: 9)

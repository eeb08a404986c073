"""`trl_ppo.legacy`: TRL 0.11's first PPOTrainer (the `step()` API), so that old scripts run with only their
imports changed. The cases are those that trl 0.11.4 asserts in its tests/test_ppo_trainer.py and
tests/test_modeling_value_head.py, plus its README's basic example, ported to tiny offline models: a 2-layer,
32-wide GPT-2 built here, and the GPT-NeoX / Llama / Qwen2 folders of conftest.py, with the word-level tokenizer.

Three intentional differences from trl 0.11 are asserted as the new behaviour at the end of the file (dropout off in
the trained model, `ratio_threshold` skipping a minibatch's optimizer step, `early_stopping` stopping before the
offending minibatch)."""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from trl_ppo.legacy import (
    AutoModelForCausalLMWithValueHead,
    PPOConfig,
    PPOTrainer,
    create_reference_model,
    respond_to_batch,
    set_seed,
)
from trl_ppo.legacy.core import LengthSampler
from trl_ppo.legacy.core import respond_to_batch as core_respond_to_batch

EXPECTED_STATS = (
    "objective/kl",
    "objective/kl_dist",
    "objective/logprobs",
    "objective/ref_logprobs",
    "objective/kl_coef",
    "objective/entropy",
    "ppo/mean_non_score_reward",
    "ppo/mean_scores",
    "ppo/std_scores",
    "tokens/queries_len_mean",
    "tokens/queries_len_std",
    "tokens/queries_dist",
    "tokens/responses_len_mean",
    "tokens/responses_len_std",
    "tokens/responses_dist",
    "ppo/loss/policy",
    "ppo/loss/value",
    "ppo/loss/total",
    "ppo/policy/entropy",
    "ppo/policy/approxkl",
    "ppo/policy/policykl",
    "ppo/policy/clipfrac",
    "ppo/policy/advantages",
    "ppo/policy/advantages_mean",
    "ppo/policy/ratio",
    "ppo/returns/mean",
    "ppo/returns/var",
    "ppo/val/vpred",
    "ppo/val/error",
    "ppo/val/clipfrac",
    "ppo/val/mean",
    "ppo/val/var",
    "ppo/val/var_explained",
    "ppo/learning_rate",
    "time/ppo/forward_pass",
    "time/ppo/compute_rewards",
    "time/ppo/compute_advantages",
    "time/ppo/optimize_step",
    "time/ppo/calc_stats",
    "time/ppo/total",
)
# the stats that are one number each (the others are per-example or per-token arrays)
SCALAR_STATS = tuple(
    key
    for key in EXPECTED_STATS
    if key
    not in (
        "objective/kl_dist",
        "objective/logprobs",
        "objective/ref_logprobs",
        "tokens/queries_dist",
        "tokens/responses_dist",
        "ppo/policy/advantages",
        "ppo/policy/ratio",
    )
)
LAYER = re.compile(r"\.(?:h|layers)\.(\d+)\.")  # transformer.h.N. (GPT-2), gpt_neox.layers.N., model.layers.N.


# ----------------------------------------------------------------------------------------------------------------
# fixtures and helpers


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread for these tiny models: on a busy 2-core machine two threads wait on each other (a step
    took seconds instead of a few hundredths). The suite's setting is restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _run_in_tmp_path(tmp_path, monkeypatch):
    """Whatever a trainer writes under relative paths (default output folders, tracker runs) lands in tmp_path."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def gpt2_path(tmp_path_factory, tokenizer):
    """A saved 2-layer, 32-wide GPT-2 causal LM (no dropout, so runs are deterministic) with the tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=128,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_dropout_prob=0.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("legacy_gpt2") / "gpt2"
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture
def arch_path(gpt2_path, model_paths):
    """arch_path(arch) -> a saved causal LM folder: "gpt2" (built here) or a conftest.py architecture."""
    return lambda arch: gpt2_path if arch == "gpt2" else model_paths[arch][0]


def load_vhead(path, seed=0):
    """The value-head model of `path`; the (new, random) value head is the same for the same seed."""
    torch.manual_seed(seed)
    return AutoModelForCausalLMWithValueHead.from_pretrained(path)


def config_for(**overrides):
    values = dict(batch_size=2, mini_batch_size=1, log_with=None)
    values.update(overrides)
    return PPOConfig(**values)


def episodes(tokenizer, query_lens, response_lens, seed=0):
    """Queries and responses of the given lengths, made of ordinary (non-special) word ids."""
    generator = torch.Generator().manual_seed(seed)
    low = max(tokenizer.all_special_ids) + 1
    draw = lambda n: torch.randint(low, len(tokenizer), (n,), generator=generator)  # noqa: E731
    return [draw(n) for n in query_lens], [draw(n) for n in response_lens]


def scores_of(*values):
    return [torch.tensor(float(v)) for v in values]


def snapshot(module):
    return {name: param.detach().clone() for name, param in module.named_parameters()}


def unwrap(module):
    return getattr(module, "module", module)


def unwrap_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)


def changed(before, module):
    after = dict(module.named_parameters())
    return {name for name, value in before.items() if not torch.equal(value, after[name].detach())}


def as_float(value):
    return float(np.asarray(value, dtype=np.float64).reshape(()))


def layer_of(name):
    match = LAYER.search(name)
    return int(match.group(1)) if match else None


def update_norm(before, module):
    after = dict(module.named_parameters())
    return math.sqrt(sum(float((after[name].detach() - value).pow(2).sum()) for name, value in before.items()))


class PairDataset(torch.utils.data.Dataset):
    """trl 0.11's DummyDataset: (query, response) pairs of tensors."""

    def __init__(self, queries, responses):
        self.queries, self.responses = queries, responses

    def __len__(self):
        return len(self.queries)

    def __getitem__(self, index):
        return self.queries[index], self.responses[index]


def pair_dataset(tokenizer, size, query_len=4, response_len=5, seed=0):
    queries, responses = episodes(tokenizer, [query_len] * size, [response_len] * size, seed=seed)
    return PairDataset(queries, responses)


def saved_weight_keys(directory):
    """The tensor names in every weights file of a `save_pretrained` folder (safetensors or torch, sharded too)."""
    keys = set()
    for file in Path(directory).iterdir():
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as handle:
                keys.update(handle.keys())
        elif file.suffix == ".bin":
            keys.update(torch.load(file, map_location="cpu", weights_only=True).keys())
    return keys


# ----------------------------------------------------------------------------------------------------------------
# PPOConfig


def test_config_has_every_field_of_trl_0_11_with_its_defaults():
    config = PPOConfig()
    assert dataclasses.is_dataclass(config)
    expected = dict(
        steps=20000,
        learning_rate=1.41e-5,
        adap_kl_ctrl=True,
        init_kl_coef=0.2,
        kl_penalty="kl",
        target=6.0,
        horizon=10000.0,
        gamma=1,
        lam=0.95,
        cliprange=0.2,
        cliprange_value=0.2,
        vf_coef=0.1,
        batch_size=128,
        forward_batch_size=None,
        mini_batch_size=128,
        gradient_accumulation_steps=1,
        ppo_epochs=4,
        max_grad_norm=None,
        optimize_cuda_cache=None,
        optimize_device_cache=False,
        early_stopping=False,
        target_kl=1.0,
        compare_steps=1,
        ratio_threshold=10.0,
        use_score_scaling=False,
        use_score_norm=False,
        score_clip=None,
        whiten_rewards=False,
        gradient_checkpointing=False,
        log_with=None,
        tracker_project_name="trl",
        tracker_kwargs={},
        accelerator_kwargs={},
        project_kwargs={},
        seed=0,
        task_name=None,
        model_name="gpt2",
        remove_unused_columns=True,
        push_to_hub_if_best_kwargs={},
        dataset_num_proc=None,
    )
    field_names = {field.name for field in dataclasses.fields(config)}
    missing = (set(expected) | {"exp_name", "query_dataset", "reward_model"}) - field_names
    assert not missing, f"PPOConfig lacks trl 0.11 fields {sorted(missing)}"
    wrong = {name: getattr(config, name) for name, value in expected.items() if getattr(config, name) != value}
    assert not wrong, f"defaults differ from trl 0.11: {wrong}"
    assert isinstance(config.exp_name, str)
    assert config.backward_batch_size == 128
    assert config.total_ppo_epochs == math.ceil(20000 / 128)
    for derived in ("world_size", "global_batch_size", "global_backward_batch_size"):
        assert hasattr(config, derived), derived
    # mutable defaults are not shared between instances
    config.tracker_kwargs["a"] = 1
    assert PPOConfig().tracker_kwargs == {}


def test_config_batch_size_must_be_a_multiple_of_the_backward_batch_size():
    with pytest.raises(ValueError):
        PPOConfig(batch_size=2, mini_batch_size=2, gradient_accumulation_steps=2)
    with pytest.raises(ValueError):
        PPOConfig(batch_size=6, mini_batch_size=4)
    config = PPOConfig(batch_size=8, mini_batch_size=2, gradient_accumulation_steps=2)
    assert config.backward_batch_size == 4
    assert config.total_ppo_epochs == math.ceil(20000 / 8)


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        # Issue 28.15: strings and None gave unclear errors, or none (the type check of `trl_ppo.PPOConfig`).
        (dict(learning_rate="1e-5"), TypeError, r"^`learning_rate` must be a float, got '1e-5' \(str\)"),
        (dict(init_kl_coef=None), TypeError, r"^`init_kl_coef` must be a float, got None"),
        (dict(seed=-1), ValueError, r"^`seed` must be in \[0, 2\*\*32 - 1\]"),
        # Issue 28.9: a negative `max_grad_norm` reversed every update.
        (dict(max_grad_norm=-1.0), ValueError, r"^`max_grad_norm` must be >= 0, got -1.0"),
        # Issue 28.1 / 28.7 in trl 0.11's names: NaN models, or a KL controller that never moves.
        (dict(vf_coef=float("inf")), ValueError, r"^`vf_coef` must be a finite number"),
        (dict(vf_coef=1e38), ValueError, r"^`vf_coef` must be at most 1000"),
        (dict(learning_rate=float("inf")), ValueError, r"^`learning_rate` must be a finite number"),
        (dict(init_kl_coef=float("nan")), ValueError, r"^`init_kl_coef` must be a finite number"),
        (dict(target=float("inf")), ValueError, r"^`target` must be a finite number"),
        (dict(horizon=float("inf")), ValueError, r"^`horizon` must be a finite number"),
    ],
)
def test_config_refuses_what_the_core_config_refuses_naming_trl_0_11s_field(overrides, error, message):
    with pytest.raises(error, match=message):
        PPOConfig(**overrides)


def test_config_forward_batch_size_is_deprecated_and_overrides_mini_batch_size():
    with pytest.warns(Warning, match="forward_batch_size"):
        config = PPOConfig(batch_size=8, forward_batch_size=2)
    assert config.mini_batch_size == 2
    assert config.backward_batch_size == 2


def test_config_optimize_cuda_cache_is_deprecated():
    with pytest.warns(Warning, match="optimize_cuda_cache"):
        PPOConfig(optimize_cuda_cache=True)


def test_config_without_deprecated_fields_does_not_warn_about_them():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        PPOConfig(batch_size=4, mini_batch_size=2)
    messages = " ".join(str(w.message) for w in caught)
    assert "forward_batch_size" not in messages and "optimize_cuda_cache" not in messages


# ----------------------------------------------------------------------------------------------------------------
# AutoModelForCausalLMWithValueHead, create_reference_model, respond_to_batch, LengthSampler, set_seed


def test_value_head_model_from_a_path_and_from_a_model(gpt2_path):
    from transformers import AutoModelForCausalLM, PreTrainedModel

    model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2_path)
    assert isinstance(model.pretrained_model, PreTrainedModel)
    assert isinstance(model.v_head.summary, nn.Linear)
    assert (model.v_head.summary.in_features, model.v_head.summary.out_features) == (32, 1)

    base = AutoModelForCausalLM.from_pretrained(gpt2_path)
    wrapped = AutoModelForCausalLMWithValueHead.from_pretrained(base)
    assert wrapped.pretrained_model is base
    assert wrapped.v_head.summary.weight.shape == (1, 32)
    # no `v_head_init_strategy`: trl 0.11 kept nn.Linear's own init, weight and bias uniform in ±1/sqrt(H)
    for head in (model.v_head.summary, wrapped.v_head.summary):
        assert head.weight.abs().max() <= 32**-0.5 and head.bias.abs().item() <= 32**-0.5
        assert head.bias.item() != 0 and head.weight.std() < 0.8 * 33**-0.5  # not the core's N(0, std 1/sqrt(H+1))


def test_value_head_init_strategy_normal_draws_the_head_from_the_given_range(gpt2_path):
    """trl 0.11's `v_head_init_strategy="normal"`: weights from N(0, `v_head_initializer_range`), bias 0; a range of
    0 is a head of zeros (every value 0 until it learns). Another strategy is refused."""
    wide = AutoModelForCausalLMWithValueHead.from_pretrained(
        gpt2_path, v_head_init_strategy="normal", v_head_initializer_range=5.0
    )
    assert 2.0 < wide.v_head.summary.weight.std().item() < 10.0 and not wide.v_head.summary.bias.any()
    zeros = AutoModelForCausalLMWithValueHead.from_pretrained(
        gpt2_path, v_head_init_strategy="normal", v_head_initializer_range=0.0
    )
    assert not zeros.v_head.summary.weight.any()
    assert not zeros(torch.tensor([[5, 6, 7]]))[2].any()
    with pytest.raises(ValueError, match="v_head_init_strategy"):
        AutoModelForCausalLMWithValueHead.from_pretrained(gpt2_path, v_head_init_strategy="orthogonal")


def test_value_head_forward_returns_logits_loss_and_values(gpt2_path, tokenizer):
    model = load_vhead(gpt2_path).eval()
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    with torch.no_grad():
        outputs = model(input_ids)
        assert len(outputs) == 3
        logits, loss, values = outputs
        assert logits.shape == (2, 6, len(tokenizer))
        assert loss is None
        assert values.shape == (2, 6)
        reference = model.pretrained_model(input_ids, output_hidden_states=True)
        torch.testing.assert_close(logits, reference.logits)
        expected_values = model.v_head.summary(reference.hidden_states[-1]).squeeze(-1)
        torch.testing.assert_close(values, expected_values)

        _, _, masked_values = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
        torch.testing.assert_close(masked_values, values)

        _, lm_loss, _ = model(input_ids=input_ids, labels=input_ids)
        assert lm_loss.dim() == 0
        torch.testing.assert_close(lm_loss, model.pretrained_model(input_ids, labels=input_ids).loss)


def test_value_head_model_generates(gpt2_path, tokenizer):
    model = load_vhead(gpt2_path).eval()
    input_ids = torch.tensor([[5, 6, 7, 8]])
    output = model.generate(input_ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert output.shape == (1, 7)
    assert torch.equal(output[:, :4], input_ids)


def test_value_head_model_save_pretrained_round_trip(gpt2_path, tmp_path):
    from transformers import AutoModelForCausalLM

    model = load_vhead(gpt2_path)
    with torch.no_grad():  # a head that cannot be mistaken for a fresh random one
        model.v_head.summary.weight.copy_(torch.linspace(-1, 1, 32).unsqueeze(0))
        model.v_head.summary.bias.fill_(0.25)
    model.save_pretrained(tmp_path / "saved")

    keys = saved_weight_keys(tmp_path / "saved")
    assert {"v_head.summary.weight", "v_head.summary.bias"} <= keys, sorted(keys)

    reloaded = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path / "saved"))
    torch.testing.assert_close(reloaded.v_head.summary.weight, model.v_head.summary.weight)
    torch.testing.assert_close(reloaded.v_head.summary.bias, model.v_head.summary.bias)
    original = model.pretrained_model.state_dict()
    for name, value in reloaded.pretrained_model.state_dict().items():
        torch.testing.assert_close(value, original[name], msg=name)

    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))
    fresh = AutoModelForCausalLM.from_pretrained(gpt2_path)
    assert set(plain.state_dict()) == set(fresh.state_dict())
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(value, original[name], msg=name)


def test_create_reference_model_is_a_frozen_independent_copy(gpt2_path):
    model = load_vhead(gpt2_path)
    ref = create_reference_model(model)
    assert ref is not model
    assert not ref.training
    assert all(not p.requires_grad for p in ref.parameters())
    assert all(p.requires_grad for p in model.parameters())
    model_before, ref_before = snapshot(model), snapshot(ref)
    for name, value in model_before.items():
        assert torch.equal(value, ref_before[name]), name

    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    input_ids = torch.tensor([[5, 6, 7, 8]])
    model(input_ids=input_ids, labels=input_ids)[1].backward()
    optimizer.step()

    moved = changed(model_before, model)
    assert {layer_of(name) for name in moved} >= {0, 1}
    assert not changed(ref_before, ref)


def test_create_reference_model_shares_and_freezes_the_first_layers(gpt2_path):
    model = load_vhead(gpt2_path)
    ref = create_reference_model(model, num_shared_layers=1)
    for name, param in model.named_parameters():
        if layer_of(name) == 0:
            assert not param.requires_grad, f"{name} of a shared layer is still trainable"
        if layer_of(name) == 1:
            assert param.requires_grad, name
    model_before, ref_before = snapshot(model), snapshot(ref)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    input_ids = torch.tensor([[5, 6, 7, 8]])
    model(input_ids=input_ids, labels=input_ids)[1].backward()
    optimizer.step()

    moved = changed(model_before, model)
    assert not {name for name in moved if layer_of(name) == 0}
    assert {name for name in moved if layer_of(name) == 1}
    assert not changed(ref_before, ref)
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        if layer_of(name) == 0:
            assert torch.equal(param, ref_params[name]), name


def test_respond_to_batch_samples_txt_len_tokens(gpt2_path, tokenizer):
    model = load_vhead(gpt2_path)
    query = tokenizer.encode("the movie was good and my day felt", return_tensors="pt")
    set_seed(0)
    response = respond_to_batch(model, query)
    assert response.shape == (1, 20)
    assert response.dtype == torch.long
    assert 0 <= int(response.min()) and int(response.max()) < len(tokenizer)
    assert core_respond_to_batch(model, torch.cat([query, query]), txt_len=5).shape == (2, 5)
    set_seed(0)
    assert torch.equal(respond_to_batch(model, query), response)  # sampling follows the seed


def test_length_sampler_and_set_seed():
    sampler = LengthSampler(2, 5)
    draws = [int(sampler()) for _ in range(200)]
    assert set(draws) == {2, 3, 4}

    set_seed(7)
    first = (random.random(), float(np.random.rand()), float(torch.rand(())))
    set_seed(7)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == first
    set_seed(8)
    assert float(torch.rand(())) != first[2]


# ----------------------------------------------------------------------------------------------------------------
# PPOTrainer: construction, the README example, step()


def test_trainer_attributes(gpt2_path, tokenizer):
    config = config_for(batch_size=4, mini_batch_size=2)
    model = load_vhead(gpt2_path)
    trainer = PPOTrainer(config, model, None, tokenizer)
    assert trainer.config is config
    assert unwrap(trainer.model) is model
    assert trainer.tokenizer is tokenizer
    assert trainer.ref_model is not None and unwrap(trainer.ref_model) is not model
    assert trainer.lr_scheduler is None
    assert isinstance(unwrap_optimizer(trainer.optimizer), torch.optim.Adam)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(config.learning_rate)
    assert trainer.kl_ctl.value == pytest.approx(0.2)
    assert trainer.is_distributed is False
    assert torch.device(trainer.current_device).type == "cpu"
    assert torch.device(trainer.accelerator.device).type == "cpu"
    assert trainer.dataloader is None
    assert (config.world_size, config.global_batch_size, config.global_backward_batch_size) == (1, 4, 2)


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "llama", "qwen2"])
def test_readme_basic_example(arch, arch_path, tokenizer):
    """trl 0.11's README "basic example", word for word but for the tiny model and the tokenizer."""
    model = AutoModelForCausalLMWithValueHead.from_pretrained(arch_path(arch))
    model_ref = create_reference_model(model)
    ppo_config = PPOConfig(batch_size=1, mini_batch_size=1)
    query_tensor = tokenizer.encode("the movie was good and my day felt", return_tensors="pt")
    response_tensor = respond_to_batch(model, query_tensor)
    assert response_tensor.shape == (1, 20)
    ppo_trainer = PPOTrainer(ppo_config, model, model_ref, tokenizer)
    before, ref_before = snapshot(model), snapshot(model_ref)

    reward = [torch.tensor(1.0)]
    train_stats = ppo_trainer.step([query_tensor[0]], [response_tensor[0]], reward)

    assert not set(EXPECTED_STATS) - set(train_stats), sorted(set(EXPECTED_STATS) - set(train_stats))
    assert as_float(train_stats["ppo/mean_scores"]) == pytest.approx(1.0)
    assert "v_head.summary.weight" in changed(before, model)
    assert len(changed(before, model)) > len(before) // 2
    assert not changed(ref_before, model_ref)


def test_step_returns_trl_0_11_stats(gpt2_path, tokenizer):
    config = config_for(batch_size=4, mini_batch_size=2, ppo_epochs=2)
    trainer = PPOTrainer(config, load_vhead(gpt2_path), load_vhead(gpt2_path), tokenizer)
    query_lens, response_lens = [2, 4, 3, 5], [3, 6, 4, 5]
    queries, responses = episodes(tokenizer, query_lens, response_lens)
    scores = [1.0, 0.0, 0.5, -1.0]
    stats = trainer.step(queries, responses, scores_of(*scores))

    assert not set(EXPECTED_STATS) - set(stats), sorted(set(EXPECTED_STATS) - set(stats))
    not_finite = [key for key in SCALAR_STATS if not math.isfinite(as_float(stats[key]))]
    assert not not_finite, not_finite
    assert as_float(stats["objective/kl_coef"]) == pytest.approx(0.2)
    assert as_float(stats["objective/kl"]) == pytest.approx(0.0, abs=1e-4)  # the reference is the same model
    assert as_float(stats["ppo/mean_scores"]) == pytest.approx(np.mean(scores))
    assert as_float(stats["ppo/std_scores"]) == pytest.approx(float(torch.tensor(scores).std()), rel=1e-5)
    assert as_float(stats["tokens/queries_len_mean"]) == pytest.approx(np.mean(query_lens))
    assert as_float(stats["tokens/responses_len_mean"]) == pytest.approx(np.mean(response_lens))
    assert as_float(stats["tokens/queries_len_std"]) == pytest.approx(float(torch.tensor(query_lens).float().std()))
    assert list(np.asarray(stats["tokens/queries_dist"]).ravel()) == query_lens
    assert list(np.asarray(stats["tokens/responses_dist"]).ravel()) == response_lens
    assert np.asarray(stats["objective/kl_dist"]).size == 4
    assert as_float(stats["ppo/learning_rate"]) == pytest.approx(config.learning_rate)
    assert all(as_float(stats[key]) >= 0 for key in EXPECTED_STATS if key.startswith("time/"))
    assert as_float(stats["ppo/policy/entropy"]) > 0
    assert 0.0 <= as_float(stats["ppo/policy/clipfrac"]) <= 1.0


def test_step_trains_the_policy_and_value_head_but_not_the_reference(gpt2_path, tokenizer):
    model, ref = load_vhead(gpt2_path), load_vhead(gpt2_path)
    trainer = PPOTrainer(config_for(), model, ref, tokenizer, dataset=pair_dataset(tokenizer, 2))
    before, ref_before = snapshot(model), snapshot(ref)
    for query_tensor, response_tensor in trainer.dataloader:
        stats = trainer.step(list(query_tensor), list(response_tensor), scores_of(1.0, 0.0))
        break
    assert not set(EXPECTED_STATS) - set(stats)

    moved = changed(before, model)
    assert {"v_head.summary.weight", "v_head.summary.bias"} <= moved
    assert {layer_of(name) for name in moved} >= {0, 1}
    assert len(moved) >= 0.9 * len(before), sorted(set(before) - moved)
    assert all(p.requires_grad for p in model.parameters())
    assert not changed(ref_before, ref)
    assert all(p.grad is None for p in ref.parameters())


def test_critic_warmup_steps_train_only_the_value_head_in_the_first_steps(gpt2_path, tokenizer):
    """trl_ppo's own field: the first `critic_warmup_steps` step()s move the value head alone (the shared backbone
    included in "the policy"), later ones move the policy too."""
    model = load_vhead(gpt2_path)
    trainer = PPOTrainer(config_for(critic_warmup_steps=1), model, None, tokenizer)
    queries, responses = episodes(tokenizer, [3, 4], [5, 2])
    before = snapshot(model)
    trainer.step(queries, responses, scores_of(1.0, -1.0))
    assert changed(before, model) == {"v_head.summary.weight", "v_head.summary.bias"}
    before = snapshot(model)
    trainer.step(queries, responses, scores_of(1.0, -1.0))
    assert len(changed(before, model)) >= 0.9 * len(before)


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_config_refuses_a_critic_warmup_that_is_not_a_count(value):
    with pytest.raises((ValueError, TypeError), match="critic_warmup_steps"):
        config_for(critic_warmup_steps=value)


def test_config_refuses_a_critic_warmup_as_long_as_the_run_in_trl011_terms():
    """`steps` episodes in batches of `batch_size` make ceil(steps / batch_size) `step()`s; a warm-up that long
    would never train the policy. The error names trl 0.11's fields, not the core config's."""
    config_for(steps=6, critic_warmup_steps=2)  # 3 steps: the last trains the policy
    with pytest.raises(ValueError, match=r"ceil\(steps / batch_size\) = 3") as error:
        config_for(steps=6, critic_warmup_steps=3)
    assert "total_episodes" not in str(error.value)


def test_step_with_response_masks(gpt2_path, tokenizer):
    """A mask of ones trains exactly as no mask; masking part of the responses trains differently."""
    queries, responses = episodes(tokenizer, [4, 4], [6, 6])
    scores = scores_of(1.0, 0.0)

    def run(masks):
        model = load_vhead(gpt2_path)
        set_seed(0)
        trainer = PPOTrainer(config_for(mini_batch_size=2, ppo_epochs=2, learning_rate=1e-3), model, None, tokenizer)
        stats = trainer.step(list(queries), list(responses), list(scores), masks)
        assert not set(EXPECTED_STATS) - set(stats)
        return snapshot(model), stats

    unmasked, _ = run(None)
    ones, _ = run([torch.ones_like(r) for r in responses])
    half = [torch.cat([torch.ones(3, dtype=torch.long), torch.zeros(3, dtype=torch.long)]) for _ in responses]
    masked, _ = run(half)
    for name, value in unmasked.items():
        torch.testing.assert_close(ones[name], value, atol=1e-6, rtol=1e-5, msg=name)
    assert any(not torch.allclose(masked[name], value, atol=1e-6) for name, value in unmasked.items())


def test_step_without_reference_model_with_sgd_and_an_lr_scheduler(gpt2_path, tokenizer):
    model = load_vhead(gpt2_path)
    initial = snapshot(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)
    trainer = PPOTrainer(
        config=config_for(),
        model=model,
        ref_model=None,
        optimizer=optimizer,
        tokenizer=tokenizer,
        dataset=pair_dataset(tokenizer, 2),
        lr_scheduler=scheduler,
    )
    assert isinstance(unwrap_optimizer(trainer.optimizer), torch.optim.SGD)
    ref = unwrap(trainer.ref_model)
    assert ref is not None and ref is not model
    assert not changed(initial, ref)  # a copy of the model as it was

    query_tensor, response_tensor = next(iter(trainer.dataloader))
    first = trainer.step(list(query_tensor), list(response_tensor), scores_of(1.0, 0.0))
    second = trainer.step(list(query_tensor), list(response_tensor), scores_of(1.0, 0.0))

    assert as_float(first["ppo/learning_rate"]) == pytest.approx(0.01)
    assert as_float(second["ppo/learning_rate"]) == pytest.approx(0.009)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0081)
    assert not set(EXPECTED_STATS) - set(second)
    assert changed(initial, model)
    assert not changed(initial, ref)
    assert all(p.grad is None for p in ref.parameters())


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "llama"])
def test_num_shared_layers_without_reference_model_freezes_the_first_layers(arch, arch_path, tokenizer):
    model = load_vhead(arch_path(arch))
    trainer = PPOTrainer(config_for(learning_rate=1e-3), model, None, tokenizer, num_shared_layers=1)
    ref = unwrap(trainer.ref_model)
    before, ref_before = snapshot(model), snapshot(ref)
    queries, responses = episodes(tokenizer, [4, 3], [5, 6])
    trainer.step(queries, responses, scores_of(1.0, 0.0))

    moved = changed(before, model)
    assert not {name for name in moved if layer_of(name) == 0}, "a shared layer was trained"
    assert {name for name in moved if layer_of(name) == 1}, "the layer after the shared ones was not trained"
    assert "v_head.summary.weight" in moved
    assert not changed(ref_before, ref)
    ref_params = dict(ref.named_parameters())
    layer0 = [name for name in before if layer_of(name) == 0]
    assert layer0
    for name in layer0:
        assert torch.equal(dict(model.named_parameters())[name], ref_params[name]), name


def test_num_shared_layers_with_a_reference_model_warns_and_shares_nothing(gpt2_path, tokenizer):
    model = load_vhead(gpt2_path)
    with pytest.warns(UserWarning, match="num_shared_layers"):
        PPOTrainer(config_for(), model, load_vhead(gpt2_path), tokenizer, num_shared_layers=1)
    assert all(p.requires_grad for p in model.parameters())


MALFORMED = {
    "queries not a list": (lambda q, r, s: (torch.stack(q), r, s), "must be a list of tensors"),
    "responses a tuple": (lambda q, r, s: (q, tuple(r), s), "must be a list of tensors"),
    "scores a tensor": (lambda q, r, s: (q, r, torch.stack(s)), "must be a list of tensors"),
    "query ints": (lambda q, r, s: ([x.tolist() for x in q], r, s), "must be tensors"),
    "score floats": (lambda q, r, s: (q, r, [float(x) for x in s]), "must be tensors"),
    "one query too few": (lambda q, r, s: (q[:1], r, s), r"Batch size \(2\) does not match number of examples"),
    "one score too many": (lambda q, r, s: (q, r, s + s[:1]), r"Batch size \(2\) does not match number of examples"),
    "2-d scores": (lambda q, r, s: (q, r, [x.reshape(1, 1) for x in s]), "Scores must be 1-dimensional"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_step_rejects_malformed_inputs_like_trl_0_11(case, gpt2_path, tokenizer):
    model = load_vhead(gpt2_path)
    trainer = PPOTrainer(config_for(), model, None, tokenizer)
    queries, responses = episodes(tokenizer, [4, 4], [5, 5])
    mangle, message = MALFORMED[case]
    before = snapshot(model)
    with pytest.raises(ValueError, match=message):
        trainer.step(*mangle(queries, responses, scores_of(1.0, 0.0)))
    assert not changed(before, model)


def test_step_accepts_one_element_scores(gpt2_path, tokenizer):
    """trl 0.11 squeezes scores of shape (1,), as its test_ppo_step_rewards_shape does after the error case."""
    model = load_vhead(gpt2_path)
    trainer = PPOTrainer(config_for(), model, None, tokenizer)
    queries, responses = episodes(tokenizer, [4, 4], [5, 5])
    before = snapshot(model)
    with pytest.raises(ValueError):
        trainer.step(queries, responses, [torch.tensor([[1.0]]), torch.tensor([[0.0]])])
    stats = trainer.step(queries, responses, [torch.tensor([1.0]), torch.tensor([0.0])])
    assert as_float(stats["ppo/mean_scores"]) == pytest.approx(0.5)
    assert changed(before, model)


def test_step_without_a_dataset(gpt2_path, tokenizer):
    model, ref = load_vhead(gpt2_path), load_vhead(gpt2_path)
    trainer = PPOTrainer(config_for(batch_size=1), model, ref, tokenizer)
    assert trainer.dataloader is None
    query_tensor = tokenizer.encode("the movie was good and my day felt", return_tensors="pt")
    set_seed(0)
    response_tensor = respond_to_batch(model, query_tensor)
    before, ref_before = snapshot(model), snapshot(ref)
    stats = trainer.step([query_tensor[0]], [response_tensor[0]], [torch.tensor([1.0])])
    assert not set(EXPECTED_STATS) - set(stats)
    assert changed(before, model)
    assert not changed(ref_before, ref)


def test_trainer_without_a_dataset_warns_like_trl_0_11(gpt2_path, tokenizer):
    with pytest.warns(UserWarning, match="dataset"):
        PPOTrainer(config_for(batch_size=1), load_vhead(gpt2_path), None, tokenizer)


def test_dataloader_batches_shuffles_and_drops_the_last_incomplete_batch(gpt2_path, tokenizer):
    config = config_for(batch_size=3, mini_batch_size=1)
    # trl 0.11 made a dataloader with no batch at all here, and a script's loop trained on nothing, silently
    with pytest.raises(ValueError, match=r"`dataset` has 2 rows, fewer than one batch \(`batch_size` = 3\)"):
        PPOTrainer(config, load_vhead(gpt2_path), None, tokenizer, dataset=pair_dataset(tokenizer, 2))

    dataset = pair_dataset(tokenizer, 7)
    trainer = PPOTrainer(config, load_vhead(gpt2_path), None, tokenizer, dataset=dataset)
    assert len(trainer.dataloader) == 2
    index_of = {tuple(q.tolist()): i for i, (q, _) in enumerate(dataset)}
    orders = set()
    for _ in range(6):
        batches = list(trainer.dataloader)
        assert [len(q) for q, _ in batches] == [3, 3]
        orders.add(tuple(index_of[tuple(q.tolist())] for queries, _ in batches for q in queries))
    assert len(orders) > 1, "the dataloader does not shuffle"


def test_dataloader_with_a_datasets_dataset_and_collator_as_in_trl_examples(gpt2_path, tokenizer):
    """trl 0.11's gpt2-sentiment loop: a tokenized `datasets.Dataset`, a list collator, generate, score, step."""
    from datasets import Dataset

    rows = ["the movie was good", "my day felt long", "our trip seemed fun", "the food was bad and cold"] * 2
    dataset = Dataset.from_dict(
        {"input_ids": [tokenizer.encode(text) for text in rows], "query": rows, "extra": list(range(len(rows)))}
    )
    dataset.set_format(type="torch")

    def collator(data):
        return {key: [d[key] for d in data] for key in data[0]}

    model = load_vhead(gpt2_path)
    config = config_for(batch_size=4, mini_batch_size=2, learning_rate=1e-3)
    trainer = PPOTrainer(config, model, None, tokenizer, dataset=dataset, data_collator=collator)
    assert len(trainer.dataloader) == 2
    before = snapshot(model)
    for batch in trainer.dataloader:
        assert {"input_ids", "query"} <= set(batch)
        assert "extra" not in batch  # remove_unused_columns=True drops what the model's forward does not take
        query_tensors = batch["input_ids"]
        response_tensors = trainer.generate(
            query_tensors, return_prompt=False, max_new_tokens=4, do_sample=True, pad_token_id=tokenizer.pad_token_id
        )
        batch["response"] = tokenizer.batch_decode(response_tensors)
        rewards = [torch.tensor(float(len(r))) for r in response_tensors]
        stats = trainer.step(query_tensors, response_tensors, rewards)
        trainer.log_stats(stats, batch, rewards)
    assert changed(before, model)


def test_max_grad_norm_clips_the_update(gpt2_path, tokenizer):
    """With plain SGD at lr=1 and one optimizer step, the update is the (clipped) gradient itself."""
    queries, responses = episodes(tokenizer, [4, 4], [5, 5])

    def update(max_grad_norm):
        model = load_vhead(gpt2_path)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        config = config_for(mini_batch_size=2, ppo_epochs=1, max_grad_norm=max_grad_norm)
        trainer = PPOTrainer(config, model, None, tokenizer, optimizer=optimizer)
        before = snapshot(model)
        trainer.step(list(queries), list(responses), scores_of(1.0, 0.0))
        return update_norm(before, model)

    assert update(None) > 1e-2  # the gradient is much larger than the bound below
    assert 0 < update(1e-3) <= 1e-3 * 1.01


@pytest.mark.parametrize("kl_penalty", ["kl", "abs", "mse", "full"])
def test_each_kl_penalty_trains_with_finite_stats(kl_penalty, gpt2_path, tokenizer):
    config = config_for(kl_penalty=kl_penalty, learning_rate=1e-2, ppo_epochs=2)
    trainer = PPOTrainer(config, load_vhead(gpt2_path), None, tokenizer)
    query_len, response_len = 4, 5
    queries, responses = episodes(tokenizer, [query_len] * 2, [response_len] * 2)
    first = trainer.step(list(queries), list(responses), scores_of(1.0, -1.0))
    second = trainer.step(list(queries), list(responses), scores_of(1.0, -1.0))
    for stats in (first, second):
        bad = [key for key in SCALAR_STATS if not math.isfinite(as_float(stats[key]))]
        assert not bad, bad
        assert np.isfinite(np.asarray(stats["objective/kl_dist"], dtype=np.float64)).all()
    assert as_float(first["objective/kl"]) == pytest.approx(0.0, abs=1e-4)  # the model is still its reference

    kl = as_float(second["objective/kl"])
    if kl_penalty != "kl":
        assert kl > 0, f"{kl_penalty} penalty of a trained model against its reference should be > 0"
    if kl_penalty == "full":
        return
    logprobs = np.asarray(second["objective/logprobs"], dtype=np.float64)
    ref_logprobs = np.asarray(second["objective/ref_logprobs"], dtype=np.float64)
    if logprobs.shape[-1] == query_len + response_len - 1:  # trl 0.11: every next-token position
        logprobs, ref_logprobs = logprobs[:, query_len - 1 :], ref_logprobs[:, query_len - 1 :]
    assert logprobs.shape == (2, response_len)
    difference = logprobs - ref_logprobs
    per_token = {"kl": difference, "abs": np.abs(difference), "mse": 0.5 * difference**2}[kl_penalty]
    assert kl == pytest.approx(per_token.sum(-1).mean(), rel=1e-3, abs=1e-6)


def test_adaptive_and_fixed_kl_controllers(gpt2_path, tokenizer):
    queries, responses = episodes(tokenizer, [4, 4], [5, 5])
    adaptive = PPOTrainer(config_for(), load_vhead(gpt2_path), None, tokenizer)
    adaptive.step(list(queries), list(responses), scores_of(1.0, 0.0))
    # KL ~ 0 is far under target=6, so the proportional error is clipped to -0.2: value *= 1 - 0.2 * n / horizon
    assert adaptive.kl_ctl.value == pytest.approx(0.2 * (1 - 0.2 * 2 / 10000.0), rel=1e-7)
    second = adaptive.step(list(queries), list(responses), scores_of(1.0, 0.0))
    assert as_float(second["objective/kl_coef"]) == pytest.approx(0.2 * (1 - 0.2 * 2 / 10000.0), rel=1e-7)

    fixed = PPOTrainer(config_for(adap_kl_ctrl=False, init_kl_coef=0.05), load_vhead(gpt2_path), None, tokenizer)
    fixed.step(list(queries), list(responses), scores_of(1.0, 0.0))
    stats = fixed.step(list(queries), list(responses), scores_of(1.0, 0.0))
    assert fixed.kl_ctl.value == 0.05
    assert as_float(stats["objective/kl_coef"]) == pytest.approx(0.05)


def test_value_loss_decreases_over_repeated_steps(gpt2_path, tokenizer):
    config = config_for(batch_size=4, mini_batch_size=2, learning_rate=3e-3)
    trainer = PPOTrainer(config, load_vhead(gpt2_path), None, tokenizer)
    queries, responses = episodes(tokenizer, [3, 4, 5, 4], [5, 5, 4, 6])
    history = [trainer.step(list(queries), list(responses), scores_of(2.0, 1.0, -1.0, 0.5)) for _ in range(6)]
    errors = [as_float(stats["ppo/val/error"]) for stats in history]
    losses = [as_float(stats["ppo/loss/value"]) for stats in history]
    assert errors[-1] < 0.5 * errors[0], errors
    assert losses[-1] < losses[0], losses


def test_gradient_accumulation_matches_a_larger_minibatch(gpt2_path, tokenizer):
    """trl 0.11's test_grad_accumulation, with SGD so that equal updates mean equal gradients."""
    queries, responses = episodes(tokenizer, [4, 4], [5, 5])

    def train(mini_batch_size, gradient_accumulation_steps):
        model = load_vhead(gpt2_path)
        config = config_for(
            mini_batch_size=mini_batch_size, gradient_accumulation_steps=gradient_accumulation_steps, ppo_epochs=1
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        PPOTrainer(config, model, None, tokenizer, optimizer=optimizer).step(
            list(queries), list(responses), scores_of(1.0, 1.0)
        )
        return model

    whole, accumulated = train(2, 1), train(1, 2)
    start = snapshot(load_vhead(gpt2_path))
    assert changed(start, whole)
    accumulated_params = dict(accumulated.named_parameters())
    for name, param in whole.named_parameters():
        torch.testing.assert_close(accumulated_params[name], param, atol=1e-6, rtol=1e-4, msg=name)


# ----------------------------------------------------------------------------------------------------------------
# PPOTrainer.generate, log_stats, save_pretrained


def greedy(tokenizer, max_new_tokens=4):
    return dict(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)


def test_generate_single_and_batched_agree(gpt2_path, tokenizer):
    trainer = PPOTrainer(config_for(), load_vhead(gpt2_path), None, tokenizer, dataset=pair_dataset(tokenizer, 2))
    texts = ["the movie was good", "my day felt very long and the food was bad"]
    inputs = [torch.tensor(tokenizer.encode(text)) for text in texts]

    batched = trainer.generate(inputs, batch_size=2, **greedy(tokenizer))
    assert isinstance(batched, list) and len(batched) == 2
    single = [trainer.generate(query, **greedy(tokenizer)) for query in inputs]
    for query, one in zip(inputs, single):
        assert one.dim() == 2 and one.shape[0] == 1
        assert torch.equal(one[0, : len(query)], query)  # return_prompt=True keeps the query
    assert tokenizer.batch_decode([one.squeeze(0) for one in single]) == tokenizer.batch_decode(batched)
    assert tokenizer.padding_side == "left"  # restored

    responses = trainer.generate(inputs, batch_size=2, return_prompt=False, **greedy(tokenizer))
    for query, full, response in zip(inputs, batched, responses):
        assert 1 <= len(response) <= 4
        assert torch.equal(full[len(query) :], response)


def test_generate_reference_responses(gpt2_path, tokenizer):
    model = load_vhead(gpt2_path)
    ref_model = copy.deepcopy(model)
    # a reference that never agrees with the model: its output embeddings negated (and untied from the input ones)
    ref_head = ref_model.pretrained_model.lm_head
    ref_head.weight = nn.Parameter(-ref_head.weight.detach().clone(), requires_grad=False)
    trainer = PPOTrainer(config_for(), model, ref_model, tokenizer)
    inputs = [torch.tensor(tokenizer.encode(text)) for text in ("the movie was good", "my day felt very long")]

    generations, ref_generations = trainer.generate(
        inputs, batch_size=2, generate_ref_response=True, **greedy(tokenizer)
    )
    singles = [trainer.generate(query, generate_ref_response=True, **greedy(tokenizer)) for query in inputs]
    decode = tokenizer.batch_decode
    assert decode([g.squeeze(0) for g, _ in singles]) == decode(generations)
    assert decode([r.squeeze(0) for _, r in singles]) == decode(ref_generations)
    assert decode(generations) != decode(ref_generations)


def test_generate_with_a_length_sampler(gpt2_path, tokenizer):
    trainer = PPOTrainer(config_for(), load_vhead(gpt2_path), None, tokenizer)
    inputs = [torch.tensor(tokenizer.encode(text)) for text in ("the movie was good", "my day", "our trip seemed fun")]
    no_stop = dict(do_sample=True, pad_token_id=tokenizer.pad_token_id)
    no_stop["suppress_tokens"] = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    for length in (2, 5):
        responses = trainer.generate(
            inputs, length_sampler=LengthSampler(length, length + 1), return_prompt=False, **no_stop
        )
        assert [len(r) for r in responses] == [length] * 3
        single = trainer.generate(inputs[0], length_sampler=LengthSampler(length, length + 1), **no_stop)
        assert single.shape == (1, len(inputs[0]) + length)


def test_log_stats_without_a_tracker(gpt2_path, tokenizer):
    trainer = PPOTrainer(config_for(), load_vhead(gpt2_path), None, tokenizer)
    queries, responses = episodes(tokenizer, [4, 4], [5, 5])
    rewards = scores_of(1.0, 0.0)
    stats = trainer.step(list(queries), list(responses), rewards)
    batch = {"query": tokenizer.batch_decode(queries), "response": tokenizer.batch_decode(responses)}
    trainer.log_stats(stats, batch, rewards)
    trainer.log_stats(stats, batch, torch.tensor([1.0, 0.0]))
    trainer.log_stats(stats, batch, rewards, columns_to_log=["query"])
    assert set(EXPECTED_STATS) <= set(stats)


def test_log_stats_to_tensorboard(gpt2_path, tokenizer, tmp_path):
    pytest.importorskip("tensorboard")
    config = config_for(log_with="tensorboard", project_kwargs={"logging_dir": str(tmp_path / "logs")})
    trainer = PPOTrainer(config, load_vhead(gpt2_path), None, tokenizer)
    queries, responses = episodes(tokenizer, [4, 4], [5, 5])
    rewards = scores_of(1.0, 0.0)
    stats = trainer.step(list(queries), list(responses), rewards)
    batch = {"query": tokenizer.batch_decode(queries), "response": tokenizer.batch_decode(responses)}
    trainer.log_stats(stats, batch, rewards)
    events = list((tmp_path / "logs").rglob("events.out.tfevents*"))
    written = sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("events.out.tfevents*"))
    assert events, f"no TensorBoard event file under project_kwargs['logging_dir']; event files written: {written}"
    content = b"".join(path.read_bytes() for path in events)
    for tag in (b"env/reward_mean", b"objective/kl", b"ppo/loss/total"):
        assert tag in content, tag


def test_trainer_save_pretrained_round_trip(gpt2_path, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = load_vhead(gpt2_path)
    trainer = PPOTrainer(config_for(learning_rate=1e-3), model, None, tokenizer)
    queries, responses = episodes(tokenizer, [4, 4], [5, 5])
    trainer.step(list(queries), list(responses), scores_of(1.0, 0.0))
    trainer.save_pretrained(str(tmp_path / "trained"))

    reloaded = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path / "trained"))
    torch.testing.assert_close(reloaded.v_head.summary.weight, model.v_head.summary.weight)
    torch.testing.assert_close(reloaded.v_head.summary.bias, model.v_head.summary.bias)
    trained = model.pretrained_model.state_dict()
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "trained"))
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(value, trained[name], msg=name)
    saved_tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "trained"))
    assert saved_tokenizer.encode("the movie was good") == tokenizer.encode("the movie was good")


# ----------------------------------------------------------------------------------------------------------------
# the intentional differences from trl 0.11 (the new behaviour is asserted, not trl 0.11's)


def test_dropout_is_off_in_the_trained_model(model_paths, tokenizer):
    """conftest's GPT-NeoX has dropout 0.1: with one minibatch and one epoch, the training forward pass must give
    exactly the rollout's log-probabilities (ratio 1), which dropout would break."""
    model = AutoModelForCausalLMWithValueHead.from_pretrained(model_paths["gpt_neox"][0])
    config = config_for(batch_size=4, mini_batch_size=4, ppo_epochs=1)
    trainer = PPOTrainer(config, model, None, tokenizer)
    queries, responses = episodes(tokenizer, [3, 4, 5, 4], [5, 5, 6, 4])
    stats = trainer.step(queries, responses, scores_of(1.0, 0.0, 0.5, -1.0))
    ratio = np.asarray(stats["ppo/policy/ratio"], dtype=np.float64)
    assert np.allclose(ratio, 1.0, atol=1e-4), (ratio.min(), ratio.max())
    assert as_float(stats["ppo/policy/approxkl"]) < 1e-8
    assert as_float(stats["ppo/policy/clipfrac"]) == 0.0


def train_epochs(gpt2_path, tokenizer, ppo_epochs, **overrides):
    """One `step()` on 2 episodes, in one minibatch, with Adam at a learning rate large enough that the second
    epoch's mean ratio is ~1.4 and its approximate KL ~0.16 -> (the weights after it, the stats)."""
    queries, responses = episodes(tokenizer, [4, 4], [5, 5])
    model = load_vhead(gpt2_path)
    config = config_for(mini_batch_size=2, ppo_epochs=ppo_epochs, learning_rate=3e-2, **overrides)
    stats = PPOTrainer(config, model, None, tokenizer).step(list(queries), list(responses), scores_of(1.0, -1.0))
    return snapshot(model), stats


def assert_same_weights(weights, expected):
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value, atol=1e-6, rtol=1e-6, msg=name)


def test_ratio_threshold_skips_the_minibatch_optimizer_step(gpt2_path, tokenizer):
    """Every epoch after the first has a mean ratio above ratio_threshold=1.1: those minibatches take no optimizer
    step, so the weights are those after one epoch (trl 0.11 zeroed their loss but still stepped Adam, whose
    momentum moved the weights)."""
    one_epoch, _ = train_epochs(gpt2_path, tokenizer, 1)
    unguarded, stats = train_epochs(gpt2_path, tokenizer, 3, ratio_threshold=1e6)
    ratio = np.asarray(stats["ppo/policy/ratio"], dtype=np.float64).reshape(3, -1)
    assert ratio[0].mean() == pytest.approx(1.0, abs=1e-4) and ratio[1].mean() > 1.1, ratio.mean(1)
    assert any(not torch.allclose(unguarded[name], value) for name, value in one_epoch.items())

    guarded, stats = train_epochs(gpt2_path, tokenizer, 3, ratio_threshold=1.1)
    assert_same_weights(guarded, one_epoch)
    assert not set(EXPECTED_STATS) - set(stats)


def test_early_stopping_stops_before_stepping_on_the_offending_minibatch(gpt2_path, tokenizer):
    """The second epoch's approximate KL exceeds 1.5 * target_kl: the update stops before stepping on it, so the
    weights are those after one epoch (trl 0.11 checked after each whole epoch, having stepped on all of it)."""
    one_epoch, _ = train_epochs(gpt2_path, tokenizer, 1)
    unguarded, stats = train_epochs(gpt2_path, tokenizer, 3, ratio_threshold=1e6)
    log_ratio = np.log(np.asarray(stats["ppo/policy/ratio"], dtype=np.float64).reshape(3, -1))
    assert 0.5 * (log_ratio[1] ** 2).mean() > 1.5 * 0.02
    assert any(not torch.allclose(unguarded[name], value) for name, value in one_epoch.items())

    guarded, stats = train_epochs(gpt2_path, tokenizer, 3, ratio_threshold=1e6, early_stopping=True, target_kl=0.02)
    assert_same_weights(guarded, one_epoch)
    assert not set(EXPECTED_STATS) - set(stats)

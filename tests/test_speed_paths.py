"""The speed options give the same algorithm: several micro-batches per training forward, the generation backends,
and frozen models stored in bf16 under bf16 mixed precision."""

from functools import partial

import pytest
import torch
from conftest import build_trainer

from trl_ppo.rollout import generation
from trl_ppo.data import prompts_on_device
from trl_ppo.rollout.generation import resolve_backend
from trl_ppo.rollout import sample_responses

real_compiled_loop = generation.sample_responses_compiled


def _train_one_update(make_config, tokenizer, load_models, prompt_dataset, value_model="separate", **overrides):
    # SGD without clipping: any error in the loss scale shows in the weights.
    config = make_config(total_episodes=8, optim="sgd", learning_rate=0.5, max_grad_norm=0.0, **overrides)
    trainer = build_trainer(config, tokenizer, load_models, prompt_dataset, value_model=value_model)
    trainer.train()
    wrapper = trainer.accelerator.unwrap_model(trainer.model)
    logs = [entry for entry in trainer.state.log_history if "objective/scores" in entry]
    return wrapper.state_dict(), logs[-1]


def test_several_micro_batches_per_forward_give_the_same_update(make_config, tokenizer, load_models, prompt_dataset):
    # per_device_train_batch_size 4 x 2 accumulation: 2 micro-batches, in 2 forwards or in 1.
    separate, separate_log = _train_one_update(make_config, tokenizer, load_models, prompt_dataset)
    merged, merged_log = _train_one_update(
        make_config, tokenizer, load_models, prompt_dataset, train_forward_batch_size=8
    )
    initial = build_trainer(make_config(), tokenizer, load_models, prompt_dataset).model.state_dict()
    moved = max((separate[name] - initial[name]).abs().max().item() for name in separate)
    assert moved > 1e-3, "the update must move the weights for this comparison to mean anything"
    for name in separate:
        torch.testing.assert_close(merged[name], separate[name], atol=1e-6, rtol=1e-5, msg=name)
    for key in ("loss/policy_avg", "loss/value_avg", "policy/approxkl_avg", "policy/entropy_avg", "val/ratio"):
        assert merged_log[key] == pytest.approx(separate_log[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("value_model", ["separate", None])
def test_chunked_logprobs_give_the_same_update(value_model, make_config, tokenizer, load_models, prompt_dataset):
    # Full logits at once (0) against the LM head on 5 response tokens at a time, recomputed in the backward.
    run = partial(_train_one_update, make_config, tokenizer, load_models, prompt_dataset, value_model)
    (chunked, chunked_log), (full, full_log) = run(logprobs_chunk_size=5), run(logprobs_chunk_size=0)
    for name in full:
        torch.testing.assert_close(chunked[name], full[name], atol=1e-6, rtol=1e-5, msg=name)
    for key in ("objective/kl", "loss/policy_avg", "loss/value_avg", "policy/entropy_avg", "val/ratio"):
        assert chunked_log[key] == pytest.approx(full_log[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("size", [6, 3])
def test_train_forward_batch_size_must_hold_whole_micro_batches(make_config, tokenizer, load_models, size):
    with pytest.raises(ValueError, match="train_forward_batch_size"):
        build_trainer(make_config(train_forward_batch_size=size), tokenizer, load_models)


def test_unknown_generation_backend_is_refused(make_config, tokenizer, load_models):
    with pytest.raises(ValueError, match="generation_backend"):
        build_trainer(make_config(generation_backend="vllm"), tokenizer, load_models)


def _sample(trainer, seed: int = 0) -> torch.Tensor:
    batch = next(iter(trainer.train_dataloader))
    queries, query_mask = prompts_on_device(batch, trainer.accelerator.device, trainer.processing_class.pad_token_id)
    torch.manual_seed(seed)
    return sample_responses(trainer._models(), queries, query_mask, trainer._sampling())


@pytest.mark.parametrize("backend", ["compiled", "compiled_loop", "generate"])
def test_generation_backends_draw_the_same_tokens(
    backend, make_config, tokenizer, load_models, prompt_dataset, monkeypatch
):
    """All backends sample softmax(logits / temperature) with the same random draws, so under one seed they
    return the same responses (on the CPU the static-cache backends run without CUDA graphs)."""
    reference = _sample(build_trainer(make_config(response_length=12), tokenizer, load_models, prompt_dataset))
    trainer = build_trainer(
        make_config(response_length=12, generation_backend=backend), tokenizer, load_models, prompt_dataset
    )
    assert trainer.sampling_backend == backend
    if backend == "compiled_loop":  # Inductor on the CPU takes a minute: the test runs the step uncompiled
        trainer.sampling_backend = "compiled_loop"
        monkeypatch.setattr(generation, "sample_responses_compiled", partial(real_compiled_loop, compile=False))
    first, second = _sample(trainer), _sample(trainer)  # the second call reuses the static cache
    assert torch.equal(first, reference) and torch.equal(second, reference)
    assert not torch.equal(_sample(trainer, seed=1), reference)


def test_static_cache_sampling_under_bf16_autocast(make_config, tokenizer, load_models, prompt_dataset):
    """Under autocast the keys leave the rotary embedding in float32 and the values are bf16: the static cache
    must hold each in its own dtype (transformers alone fails to copy the values in)."""
    config = make_config(response_length=12, generation_backend="compiled", bf16=True, use_cpu=True)
    responses = _sample(build_trainer(config, tokenizer, load_models, prompt_dataset))
    assert responses.shape == (8, 12)


def test_auto_backend_compiles_only_on_cuda_without_zero3_or_peft():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert resolve_backend("auto", cuda, None, peft=False) == "compiled"
    assert resolve_backend("auto", cuda, 2, peft=False) == "compiled"
    assert resolve_backend("auto", cuda, 3, peft=False) == "kv_cache"
    assert resolve_backend("auto", cuda, None, peft=True) == "kv_cache"
    assert resolve_backend("auto", cpu, None, peft=False) == "kv_cache"
    assert resolve_backend("generate", cpu, None, peft=False) == "generate"


def test_frozen_models_keep_linear_weights_in_bf16_and_match_the_policy(
    make_config, tokenizer, load_models, prompt_dataset
):
    trainer = build_trainer(make_config(bf16=True, use_cpu=True), tokenizer, load_models, prompt_dataset)
    ref = trainer.ref_model
    assert ref.get_output_embeddings().weight.dtype == torch.bfloat16
    assert ref.get_input_embeddings().weight.dtype == torch.float32  # autocast does not cast embeddings or norms
    assert all(p.dtype == torch.float32 for n, p in ref.named_parameters() if "layernorm" in n)
    reward_dtypes = {p.dtype for n, p in trainer.reward_model.named_parameters() if "score" in n}
    assert reward_dtypes == {torch.bfloat16}
    batch = next(iter(trainer.train_dataloader))
    rollout = trainer.collect_rollout(batch)
    # Before any update the policy is the reference: with the same bf16 products, the same log-probabilities.
    assert torch.equal(rollout.logprobs, rollout.ref_logprobs)


def test_trim_padding_drops_only_columns_that_are_padding_everywhere():
    from trl_ppo.rollout import Rollout

    query_mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)
    response_mask = torch.tensor([[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    rollout = Rollout(
        torch.arange(8).view(2, 4), query_mask, torch.arange(10).view(2, 5), response_mask, values=torch.ones(2, 5)
    )
    trimmed = rollout.trim_padding()
    assert torch.equal(trimmed.queries, torch.tensor([[1, 2, 3], [5, 6, 7]]))
    assert torch.equal(trimmed.responses, torch.tensor([[0, 1], [5, 6]]))
    assert trimmed.values.shape == (2, 2) and trimmed.query_mask.shape == (2, 3)


def test_trimmed_padding_gives_the_same_rollout_and_update(
    make_config, tokenizer, load_models, prompt_dataset, monkeypatch
):
    """Forward passes over episodes without their common padding columns compute the same log-probs, values and
    update as over the full width (responses of 1-5 tokens in a width of 6, prompts of 1-6 words)."""
    from trl_ppo.rollout import Rollout

    def rollout_and_update():
        config = make_config(optim="sgd", learning_rate=0.5, max_grad_norm=0.0)
        trainer = build_trainer(config, tokenizer, load_models, prompt_dataset)
        batch = next(iter(trainer.train_dataloader))
        queries, query_mask = prompts_on_device(
            batch, trainer.accelerator.device, trainer.processing_class.pad_token_id
        )
        torch.manual_seed(0)
        response_mask = torch.arange(6)[None] < torch.tensor([2, 4, 3, 1, 5, 2, 4, 3])[:, None]
        responses = torch.randint(3, len(tokenizer), (8, 6)).masked_fill(~response_mask, tokenizer.pad_token_id)
        rollout = trainer.add_logprobs_and_values(Rollout(queries, query_mask, responses, response_mask))
        rollout.scores = torch.linspace(-1.0, 1.0, 8)
        advantages = trainer.compute_advantages(rollout, trainer.compute_rewards(rollout))
        trainer.ppo_update(rollout, advantages)
        narrowest = min(rollout.select(torch.arange(i, i + 4)).trim_padding().queries.size(1) for i in (0, 4))
        return rollout, trainer.accelerator.unwrap_model(trainer.model).state_dict(), narrowest, queries.size(1)

    trimmed, trimmed_weights, narrowest, width = rollout_and_update()
    assert narrowest < width, "some pass must have prompt padding to drop"
    monkeypatch.setattr(Rollout, "trim_padding", lambda self: self)
    full, full_weights, _, _ = rollout_and_update()
    for name in ("logprobs", "ref_logprobs", "values"):
        torch.testing.assert_close(getattr(trimmed, name), getattr(full, name), atol=1e-6, rtol=1e-5, msg=name)
    for name in full_weights:
        torch.testing.assert_close(trimmed_weights[name], full_weights[name], atol=1e-6, rtol=1e-5, msg=name)

"""`generate()` / `step()` / `log_stats()` inputs that slipped through or failed unclearly (issue 36), core and
legacy: keyword overrides of `generate()`, boolean responses, a query of only pad ids, scores that are not
numbers, a NaN KL coefficient or reward, a tensor without values; `value_head_init` where no head is added."""

import logging

import pytest
import torch
from conftest import build_trainer
from test_legacy import _one_thread, _run_in_tmp_path, config_for, gpt2_path, load_vhead, scores_of  # noqa: F401
from test_legacy import episodes as legacy_episodes
from test_output_dir import episodes

BAD_GENERATION_KWARGS = [
    (dict(temperature=-1.0), r"`temperature` must be a finite number > 0 .*got -1\.0"),
    (dict(temperature=0), r"`temperature` must be a finite number > 0 .*got 0"),
    (dict(temperature=float("nan")), r"`temperature` must be a finite number > 0"),
    (dict(eos_token_id=10**6), r"`eos_token_id` must be a token id .* in \[0, \d+\), the policy's vocabulary, got "
     r"1000000"),
    (dict(eos_token_id=[1, -3]), r"`eos_token_id` must be a token id"),
    (dict(top_p=0.0), r"`top_p` must be a number in \(0, 1\], got 0\.0"),
    (dict(top_k=-2), r"`top_k` must be an integer >= 0, got -2"),
    (dict(top_k=1.5), r"`top_k` must be an integer >= 0, got 1\.5"),  # 0.0, as TRL's tutorials pass it, is fine
]


@pytest.mark.parametrize("kwargs, message", BAD_GENERATION_KWARGS)
def test_core_generate_checks_its_keyword_overrides(kwargs, message, make_config, tokenizer, load_models):
    trainer = build_trainer(make_config(), tokenizer, load_models)
    queries, _, _ = episodes(tokenizer, 2)
    rng = torch.get_rng_state()
    with pytest.raises(ValueError, match=rf"^`generate\(\)`'s {message}"):
        trainer.generate(queries, **kwargs)
    assert torch.equal(rng, torch.get_rng_state())  # nothing was sampled


@pytest.mark.parametrize("kwargs, message", BAD_GENERATION_KWARGS[:4])
def test_legacy_generate_checks_its_keyword_overrides(kwargs, message, gpt2_path, tokenizer):
    from trl_ppo.legacy import PPOTrainer

    trainer = PPOTrainer(config_for(), load_vhead(gpt2_path), None, tokenizer)
    queries, _ = legacy_episodes(tokenizer, [3, 2], [1, 1])
    with pytest.raises(ValueError, match=rf"^`generate\(\)`'s {message}"):
        trainer.generate(queries, return_prompt=False, **kwargs)


def test_core_step_refuses_boolean_responses_and_scores_that_are_not_numbers(make_config, tokenizer, load_models):
    trainer = build_trainer(make_config(), tokenizer, load_models)
    queries, responses, scores = episodes(tokenizer)
    masks = [torch.ones_like(response, dtype=torch.bool) for response in responses]
    with pytest.raises(ValueError, match=r"`responses\[0\]` is a boolean tensor \(a mask\?\); give the token ids"):
        trainer.step(queries, masks, scores)
    for bad in ("0.5", None):
        with pytest.raises(ValueError, match=rf"`step\(\)`: score 3 is {bad!r} \({type(bad).__name__}\): each score "
                                             r"must be a number"):
            trainer.step(queries, responses, [*scores[:3], bad, *scores[4:]])
    with pytest.raises(ValueError, match=r"`queries\[0\]` must be a 1-D tensor of token ids, got list .*tokenize the"):
        trainer.step([["the", "movie"]] * 8, responses, scores)
    no_values = [torch.empty(3, dtype=torch.long, device="meta") for _ in responses]
    with pytest.raises(ValueError, match=r"`responses\[0\]` is on the meta device"):
        trainer.step(queries, no_values, scores)
    assert trainer.state.global_step == 0


def test_legacy_step_refuses_boolean_responses_pad_queries_and_a_nan_kl_coefficient(gpt2_path, tokenizer):
    from trl_ppo.legacy import PPOTrainer

    trainer = PPOTrainer(config_for(), load_vhead(gpt2_path), None, tokenizer)
    queries, responses = legacy_episodes(tokenizer, [3, 2], [2, 2])
    masks = [torch.ones(2, dtype=torch.bool)] * 2
    with pytest.raises(ValueError, match=r"`responses\[0\]` is a boolean tensor \(a mask\?\)"):
        trainer.step(queries, masks, scores_of(1.0, 0.0))
    pads = [queries[0], torch.full((3,), tokenizer.pad_token_id)]
    with pytest.raises(ValueError, match=r"`queries\[1\]` is made only of pad ids"):
        trainer.step(pads, responses, scores_of(1.0, 0.0))
    with pytest.raises(ValueError, match=r"`kl_ctl.value` \(the KL coefficient\) must be a finite number >= 0, got na"):
        trainer.kl_ctl.value = float("nan")
    assert trainer.kl_ctl.value == trainer.config.init_kl_coef
    with pytest.raises(ValueError, match=r"^`log_stats\(\)`'s `rewards` got a non-finite score \(nan\)"):
        trainer.log_stats({}, {"query": ["a", "b"], "response": ["c", "d"]}, scores_of(1.0, float("nan")))
    assert trainer.trainer.state.global_step == 0


def test_value_head_init_with_a_separate_value_model_warns(make_config, tokenizer, load_models, caplog):
    with caplog.at_level(logging.WARNING):
        build_trainer(make_config(value_head_init="normal"), tokenizer, load_models)
    assert "`value_head_init='normal'` has no effect: a separate `value_model` is given" in caplog.text

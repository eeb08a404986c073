"""What a user meets on every run stays quiet: sampling, the value head, gradient checkpointing and the legacy
config use the names the installed transformers release has (no deprecation warning, no "deprecated" log line),
and DeepSpeed's "Setting accelerator to CPU" notice is not printed once trl_ppo is imported."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import build_trainer
from transformers.utils import logging as hf_logging

from trl_ppo.rollout import generation
from trl_ppo.compat import returned_cache


@contextlib.contextmanager
def no_warnings():
    """Any Python warning raises; every warning transformers logs (`warning_once` too, its memory cleared) is
    collected and must be none."""
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    library_logger = logging.getLogger("transformers")
    library_logger.addHandler(handler)
    hf_logging.warning_once.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            yield
    finally:
        library_logger.removeHandler(handler)
    assert [record.getMessage() for record in records] == []


def prompts(tokenizer):
    batch = tokenizer(["the movie was", "my day"], padding=True, return_tensors="pt")
    return batch["input_ids"], batch["attention_mask"].bool()


@pytest.mark.parametrize("arch", ["gpt_neox", "llama"])
@pytest.mark.parametrize(
    "backend",
    [
        generation.sample_responses,
        lambda *args: generation.sample_responses_compiled(*args, compile=False),
        generation.generate_with_transformers,
        lambda *args: generation.generate_with_transformers(*args, static_cache=True),
    ],
    ids=["kv_cache", "compiled_loop", "generate", "compiled"],
)
def test_sampling_emits_no_deprecation_warning(arch, backend, tokenizer, load_models):
    policy = load_models(arch)[0].eval()
    queries, mask = prompts(tokenizer)
    with no_warnings():
        responses = backend(policy, queries, mask, 5, 0.7, None, tokenizer.pad_token_id)
    assert responses.shape == (2, 5)


def test_the_value_head_returns_the_cache_without_warnings(tokenizer, model_paths):
    from trl_ppo import AutoModelForCausalLMWithValueHead
    from trl_ppo.legacy import AutoModelForCausalLMWithValueHead as LegacyValueHead
    from trl_ppo.legacy.core import respond_to_batch

    queries, mask = prompts(tokenizer)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(model_paths["llama"][0])
    legacy = LegacyValueHead.from_pretrained(model_paths["llama"][0])
    with no_warnings():
        output = model(input_ids=queries, attention_mask=mask.long(), use_cache=True)
        assert returned_cache(output) is not None  # a field of the old name was dropped by newer transformers
        *_, past = legacy(input_ids=queries, attention_mask=mask.long(), use_cache=True, return_past_key_values=True)
        legacy(input_ids=queries[:, -1:], past_key_values=past, return_past_key_values=True)
        respond_to_batch(legacy, queries[:1], txt_len=3)


def test_gradient_checkpointing_and_the_legacy_config_emit_no_deprecation_warning(
    make_config, tokenizer, load_models, prompt_dataset
):
    from trl_ppo.compat import CHECKPOINTING_FIELD
    from trl_ppo.legacy import PPOConfig as LegacyPPOConfig
    from trl_ppo.legacy.config import core_config

    with no_warnings():
        config = make_config(total_episodes=8, num_ppo_epochs=1, **{CHECKPOINTING_FIELD: True})
        trainer = build_trainer(config, tokenizer, load_models, prompt_dataset, arch="llama")
        legacy = core_config(LegacyPPOConfig(batch_size=4, mini_batch_size=2, gradient_checkpointing=True), None)
    assert getattr(legacy, CHECKPOINTING_FIELD) is True
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    assert any(getattr(module, "gradient_checkpointing", False) for module in policy.modules())


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="DeepSpeed finds the GPU and says nothing")
def test_deepspeed_cpu_notice_is_dropped_and_its_other_messages_kept():
    """accelerate imports DeepSpeed whenever a model is unwrapped (`Trainer.__init__`); on import DeepSpeed warns
    "Setting accelerator to CPU" on every machine without a GPU."""
    code = (
        "import trl_ppo, torch, logging; from accelerate import Accelerator\n"
        "Accelerator().unwrap_model(torch.nn.Linear(1, 1))\n"
        "logging.getLogger('DeepSpeed').warning('another DeepSpeed warning')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "Setting accelerator to CPU" not in output and "another DeepSpeed warning" in output, output


def test_the_license_is_an_spdx_expression_for_a_setuptools_that_reads_it():
    """A `project.license` table makes setuptools warn at every install; the SPDX string needs setuptools >= 77."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as handle:
        pyproject = tomllib.load(handle)
    assert pyproject["project"]["license"] == "Apache-2.0"
    setuptools = next(Requirement(r) for r in pyproject["build-system"]["requires"] if r.startswith("setuptools"))
    assert not setuptools.specifier.contains("76.9") and setuptools.specifier.contains("77.0")

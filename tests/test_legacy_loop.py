"""The loop of the old tutorials (gpt2-sentiment style), run with only the imports changed to `trl_ppo.legacy`:
a tiny GPT-2 learns a rule reward within 10 epochs of 4 steps."""

import copy

import pytest
import torch
from datasets import Dataset
from transformers import GPT2Config, GPT2LMHeadModel

from trl_ppo.legacy import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer, create_reference_model
from trl_ppo.legacy.core import LengthSampler


@pytest.mark.slow
def test_the_tutorial_loop_raises_the_reward(tmp_path, tokenizer):
    tokenizer = copy.deepcopy(tokenizer)  # the session's is shared with every other test
    tokenizer.pad_token = tokenizer.eos_token  # as the tutorials do
    torch.manual_seed(0)
    gpt2 = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=4,
        n_positions=64,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    GPT2LMHeadModel(gpt2).save_pretrained(tmp_path / "gpt2")
    words = "the movie was good my day felt long our trip seemed fun".split()
    prompts = [" ".join(words[i % 7 : i % 7 + 1 + i % 4]) for i in range(64)]  # 4 steps of 16 per epoch
    dataset = Dataset.from_dict({"query": prompts}).map(lambda row: {"input_ids": tokenizer.encode(row["query"])})
    dataset.set_format("torch")

    def collator(data):
        return {key: [d[key] for d in data] for key in data[0]}

    def score(response):  # the share of response tokens from the first half of the vocabulary (~0.5 at random)
        return torch.tensor(float((response < len(tokenizer) // 2).float().mean()))

    config = PPOConfig(
        model_name="tiny-gpt2", learning_rate=3e-3, batch_size=16, mini_batch_size=8, init_kl_coef=0.05, seed=0
    )
    model = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path / "gpt2"))
    ref_model = create_reference_model(model)
    ppo_trainer = PPOTrainer(config, model, ref_model, tokenizer, dataset=dataset, data_collator=collator)
    generation_kwargs = {"min_length": -1, "top_k": 0.0, "top_p": 1.0, "do_sample": True}
    generation_kwargs["pad_token_id"] = tokenizer.eos_token_id
    mean_rewards = []
    for _ in range(10):
        for batch in ppo_trainer.dataloader:
            query_tensors = batch["input_ids"]
            response_tensors = ppo_trainer.generate(
                query_tensors, return_prompt=False, length_sampler=LengthSampler(4, 8), **generation_kwargs
            )
            batch["response"] = tokenizer.batch_decode(response_tensors)
            rewards = [score(response) for response in response_tensors]
            stats = ppo_trainer.step(query_tensors, response_tensors, rewards)
            ppo_trainer.log_stats(stats, batch, rewards)
            mean_rewards.append(torch.stack(rewards).mean().item())
    assert len(mean_rewards) == 40
    first, last = sum(mean_rewards[:8]) / 8, sum(mean_rewards[-8:]) / 8
    assert last - first > 0.2, mean_rewards  # seeds 0-3 gave 0.29 to 0.44
    assert stats["objective/kl"] > 0  # it moved away from the reference, and the KL says so


def test_a_step_api_run_resumes_from_its_checkpoint_exactly(tmp_path, tokenizer):
    """trl 0.11 could not resume: here save_checkpoint() after two steps, then a new trainer's load_checkpoint()
    and a third step end where the uninterrupted run ends (weights, value head, KL coefficient, score moments)."""
    torch.manual_seed(0)
    gpt2 = GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=32, vocab_size=len(tokenizer))
    GPT2LMHeadModel(gpt2).save_pretrained(tmp_path / "gpt2")
    queries = [torch.tensor(tokenizer.encode(text)) for text in ("the movie", "my day was", "our trip", "fun")]
    responses = [torch.tensor(tokenizer.encode(text)) for text in ("was good", "long", "seemed fun ok", "day")]
    scores = [torch.tensor(float(i)) for i in range(4)]

    def trainer():
        model = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path / "gpt2"))
        config = PPOConfig(batch_size=4, mini_batch_size=2, learning_rate=1e-2, use_score_scaling=True)
        config.output_dir = str(tmp_path / "run")
        return PPOTrainer(config, model, None, tokenizer)

    uninterrupted = trainer()
    for _ in range(2):
        uninterrupted.step(queries, responses, scores)
    path = uninterrupted.save_checkpoint()
    uninterrupted.step(queries, responses, scores)

    resumed = trainer()
    assert resumed.load_checkpoint(path) == 2
    resumed.step(queries, responses, scores)
    expected, got = uninterrupted.model.state_dict(), resumed.model.state_dict()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)
    assert resumed.kl_ctl.value == uninterrupted.kl_ctl.value != 0.2
    assert resumed.trainer.run.score_moments.count == uninterrupted.trainer.run.score_moments.count == 12

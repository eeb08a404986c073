"""Log-probabilities from the final hidden states in chunks (`logprobs_chunk_size`) equal those of the plain
forward with full logits: values, entropies and gradients, for each architecture the tests build."""

import pytest
import torch
from conftest import ARCHITECTURES, tiny_config

from trl_ppo import ppo
from trl_ppo.logprobs import chunked_token_logprobs, hidden_state_parts, position_ids_from_mask, response_logprobs
from trl_ppo.value_head import AutoModelForCausalLMWithValueHead


@pytest.mark.parametrize("chunk_size", [1, 4, 100])
def test_chunked_logprobs_equal_the_full_logits_with_gradients(chunk_size):
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11)
    hidden = torch.randn(2, 7, 8, requires_grad=True)  # 14 tokens: chunks of 4 leave a remainder
    tokens = torch.randint(0, 11, (2, 7))
    weights = torch.randn(2, 7)  # a loss that weighs each token differently

    full_logits = head(hidden) / 0.7
    expected = ppo.logprobs_from_logits(full_logits, tokens)
    expected_entropy = ppo.entropy_from_logits(full_logits)
    expected_grads = torch.autograd.grad((expected * weights).sum(), [hidden, head.weight, head.bias])

    logprobs, entropy = chunked_token_logprobs(head, hidden, tokens, 0.7, chunk_size, entropy=True)
    assert logprobs.shape == entropy.shape == (2, 7) and not entropy.requires_grad
    grads = torch.autograd.grad((logprobs * weights).sum(), [hidden, head.weight, head.bias])
    torch.testing.assert_close(logprobs, expected)
    torch.testing.assert_close(entropy, expected_entropy.detach())
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad)


def _episodes(vocab: int):
    torch.manual_seed(1)
    input_ids = torch.randint(3, vocab, (3, 9))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0  # left padding
    attention_mask[1, :1] = 0
    return input_ids, attention_mask, input_ids[:, -4:]


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("value_head", [False, True])
def test_response_logprobs_chunked_equal_the_plain_forward(arch, value_head, tokenizer):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, tokenizer))
    if value_head:
        model = AutoModelForCausalLMWithValueHead(model)
    assert hidden_state_parts(AutoModelForCausalLM.from_config(tiny_config(arch, tokenizer))) is not None
    inputs = _episodes(len(tokenizer))

    plain = response_logprobs(model, *inputs, temperature=0.7, chunk_size=0, entropy=True)
    plain_grads = torch.autograd.grad(plain.logprobs.sum(), list(model.parameters()), allow_unused=True)
    chunked = response_logprobs(model, *inputs, temperature=0.7, chunk_size=5, entropy=True)
    chunked_grads = torch.autograd.grad(chunked.logprobs.sum(), list(model.parameters()), allow_unused=True)

    torch.testing.assert_close(chunked.logprobs, plain.logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked.entropy, plain.entropy, atol=1e-5, rtol=1e-5)
    assert chunked.logits is None
    if value_head:
        torch.testing.assert_close(chunked.values, plain.values, atol=1e-5, rtol=1e-5)
    for grad, plain_grad in zip(chunked_grads, plain_grads):
        if plain_grad is not None:
            torch.testing.assert_close(grad, plain_grad, atol=1e-5, rtol=1e-4)


def test_models_with_their_own_logit_processing_are_called_whole(tokenizer):
    from transformers import AutoModelForCausalLM, Gemma2Config, GPTNeoXForCausalLM

    class ScaledLogits(GPTNeoXForCausalLM):  # a custom class may do anything after the head
        pass

    config = tiny_config("gpt_neox", tokenizer)
    assert hidden_state_parts(ScaledLogits(config)) is None
    gemma = Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    assert hidden_state_parts(AutoModelForCausalLM.from_config(gemma)) is None  # soft-caps its logits
    # ... and asked for the logits, the plain forward runs whatever the model.
    model = AutoModelForCausalLM.from_config(config)
    output = response_logprobs(model, *_episodes(len(tokenizer)), temperature=1.0, chunk_size=4, keep_logits=True)
    assert output.logits.shape == (3, 4, len(tokenizer))


@pytest.mark.parametrize("chunk_size", [0, 100])
def test_temperature_divides_float32_logits_under_bf16_autocast(chunk_size, tokenizer):
    """The old log-probabilities must be those of the distribution the sampler drew from: softmax of the float32
    logits / temperature (the sampler's), also when the forward runs in bf16."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("gpt_neox", tokenizer))
    input_ids, attention_mask, responses = _episodes(len(tokenizer))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        output = response_logprobs(model, input_ids, attention_mask, responses, 0.7, chunk_size)
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask)
        inputs["position_ids"] = position_ids_from_mask(attention_mask)
        if chunk_size:  # the same head on the same hidden states, as the chunked path computes them
            backbone, head = hidden_state_parts(model)
            logits = head(backbone(**inputs).last_hidden_state[:, -5:-1].reshape(-1, 32)).reshape(3, 4, -1)
        else:
            logits = model(**inputs, logits_to_keep=5).logits[:, :-1]
    assert logits.dtype == torch.bfloat16
    expected = torch.log_softmax(logits.float() / 0.7, dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(output.logprobs, expected, rtol=0, atol=1e-6)

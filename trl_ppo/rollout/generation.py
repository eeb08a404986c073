"""Generation backends: how the policy samples responses during a rollout.

A backend is one function with the signature of `sample_responses` (the policy LM, left-padded prompts
`[B, Lq]` and their mask in; response ids `[B, response_length]` out, padded after the stop token), so a faster
backend is a new function of that shape, not a new trainer. `generation_backend` picks one for a run:

* `sample_responses` ('kv_cache'): a plain sampling loop over the model's KV cache; any device, any launcher.
* `generate_with_transformers` ('generate'), and with a static KV cache ('compiled'): transformers' `generate`,
  which compiles its decoding step with CUDA graphs when the cache is static and the model is on a GPU, so the
  per-token cost is a graph replay instead of hundreds of kernel launches from Python.
* `sample_responses_compiled` ('compiled_loop', experimental): the same static cache and compiled step, driven by
  the loop of `sample_responses` instead of `generate`'s per-token Python.
* 'vllm': a vLLM engine (`vllm_engine.py`) samples the training rollouts (`collect.sample_rollout`, given the
  engine); sampling without the engine (completion tables, `generate`) is 'kv_cache''s here.

All of them sample from softmax(logits / temperature) over the whole vocabulary, the distribution that the PPO
update computes log-probabilities under, unless `generation_kwargs` ask for more (top-k, ...).
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn

from .. import ppo
from ..compat import CACHE_KEYWORD, cache_keyword, returned_cache
from ..distributed import all_processes
from ..logprobs import position_ids_from_mask


@torch.no_grad()
def sample_responses(
    model: nn.Module,
    queries: torch.Tensor,
    query_mask: torch.Tensor,
    response_length: int,
    temperature: float,
    stop_token_id: int | None,
    pad_token_id: int,
    synced_processes: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample `response_length` tokens after each left-padded prompt with a KV cache. -> `[B, response_length]`.

    Tokens are drawn from softmax(logits / temperature) over the whole vocabulary (no top-k/top-p), the same
    distribution the training forward computes, with `generator` (None: the process-wide one). After a row's stop
    token the row is filled with
    `pad_token_id`; sampling stops early once every row has stopped, on every process when `synced_processes`
    (ZeRO-3 with partitioned weights: each forward is a collective, so all processes step together).
    """
    attention_mask = query_mask.long()
    position_ids = position_ids_from_mask(attention_mask)
    output = model(
        input_ids=queries, attention_mask=attention_mask, position_ids=position_ids, use_cache=True, logits_to_keep=1
    )
    past, keyword = returned_cache(output), cache_keyword(model)

    def step(next_tokens: torch.Tensor, positions: torch.Tensor, done: int) -> torch.Tensor:
        nonlocal attention_mask, past
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.size(0), 1)], dim=1)
        output = model(
            input_ids=next_tokens.unsqueeze(1),
            attention_mask=attention_mask,
            position_ids=positions,
            use_cache=True,
            **{keyword: past},
        )
        past = returned_cache(output)
        return output.logits[:, -1, :]

    return _sampling_loop(
        output.logits[:, -1, :],
        step,
        position_ids[:, -1:] + 1,
        response_length,
        temperature,
        stop_token_id,
        pad_token_id,
        synced_processes,
        generator,
    )


@torch.no_grad()
def sample_responses_compiled(
    model: nn.Module,
    queries: torch.Tensor,
    query_mask: torch.Tensor,
    response_length: int,
    temperature: float,
    stop_token_id: int | None,
    pad_token_id: int,
    synced_processes: bool = False,
    compile: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """`sample_responses` over a preallocated static KV cache, each decoding step one call of the model compiled by
    transformers' `get_compiled_call` (CUDA graphs on a GPU), without `generate`'s per-token Python.

    Every shape is fixed: the attention mask spans the whole cache (`[B, cache length]`, filled in place as tokens
    are drawn). Falls back to `sample_responses` under `synced_processes` or without a `StaticCache`."""
    batch_size, prompt_length = queries.shape
    cache = _reusable_static_cache(model, batch_size, prompt_length + response_length, queries.device)
    if cache is None or synced_processes:
        return sample_responses(model, queries, query_mask, response_length, temperature, stop_token_id,
                                pad_token_id, synced_processes, generator)  # fmt: skip
    attention_mask = query_mask.new_zeros(batch_size, _cache_length(prompt_length + response_length), dtype=torch.long)
    attention_mask[:, :prompt_length] = query_mask
    position_ids = position_ids_from_mask(query_mask)
    keyword = cache_keyword(model)
    output = model(
        input_ids=queries,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        logits_to_keep=1,
        **{keyword: cache},
    )
    decode = model.get_compiled_call(None) if compile and hasattr(model, "get_compiled_call") else model

    def step(next_tokens: torch.Tensor, positions: torch.Tensor, done: int) -> torch.Tensor:
        attention_mask[:, prompt_length + done - 1] = 1  # the token drawn last, now in the cache
        output = decode(
            input_ids=next_tokens.unsqueeze(1),
            attention_mask=attention_mask,
            position_ids=positions,
            use_cache=True,
            **{keyword: cache},
        )
        return output.logits[:, -1, :]

    return _sampling_loop(
        output.logits[:, -1, :],
        step,
        position_ids[:, -1:] + 1,
        response_length,
        temperature,
        stop_token_id,
        pad_token_id,
        False,
        generator,
    )


def _sampling_loop(
    logits, step, positions, response_length, temperature, stop_token_id, pad_token_id, synced_processes, generator
) -> torch.Tensor:
    """Draw tokens from softmax(`logits` / temperature) `[B, V]`, then from the logits that `step(tokens,
    positions, drawn so far)` returns for them, until `response_length` tokens or every row stopped; with
    `generator` (None: the process-wide one)."""
    finished = torch.zeros(logits.size(0), dtype=torch.bool, device=logits.device)
    tokens = []
    while True:
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        next_tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1).masked_fill(finished, pad_token_id)
        tokens.append(next_tokens)
        if stop_token_id is not None:
            finished |= next_tokens == stop_token_id
        # Without a stop token no row finishes early: skip the check, a device-to-host sync per token on a GPU.
        done = len(tokens) >= response_length or (stop_token_id is not None and bool(finished.all()))
        if synced_processes:
            done = all_processes(done, logits.device)
        if done:
            break
        logits = step(next_tokens, positions, len(tokens))
        positions = positions + 1
    return ppo.pad_responses(torch.stack(tokens[:response_length], dim=1), response_length, pad_token_id)


@torch.no_grad()
def generate_with_transformers(
    model: nn.Module,
    queries: torch.Tensor,
    query_mask: torch.Tensor,
    response_length: int,
    temperature: float,
    stop_token_id: int | None,
    pad_token_id: int,
    synced_processes: bool = False,
    static_cache: bool = False,
    **generation_kwargs,
) -> torch.Tensor:
    """`sample_responses` through `model.generate`. -> `[B, response_length]`, padded after the stop token.

    With `static_cache`, the KV cache is preallocated and reused across calls of the same shape, which lets
    `generate` compile its decoding step with CUDA graphs on a GPU. Other `generation_kwargs` (top-k, top-p,
    repetition penalty, ...) reach `generate`; PPO then still computes log-probabilities under the plain
    softmax(logits / temperature), not under the distribution these options sample from."""
    generation_kwargs.setdefault("do_sample", True)
    generation_kwargs.setdefault("top_k", 0)  # generate()'s own default is top-k 50
    generation_kwargs.setdefault("top_p", 1.0)
    if static_cache:
        cache = _reusable_static_cache(model, queries.size(0), queries.size(1) + response_length, queries.device)
        if cache is None:
            generation_kwargs.setdefault("cache_implementation", "static")
        else:
            generation_kwargs[CACHE_KEYWORD] = cache
    output = model.generate(
        input_ids=queries,
        attention_mask=query_mask.long(),
        max_new_tokens=response_length,
        min_new_tokens=0,
        temperature=temperature,
        eos_token_id=stop_token_id,
        pad_token_id=pad_token_id,
        synced_gpus=synced_processes,
        **generation_kwargs,
    )
    responses = ppo.truncate_after_stop_token(output[:, queries.size(1) :], stop_token_id, pad_token_id)
    return ppo.pad_responses(responses, response_length, pad_token_id)


_STATIC_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(B, length, dtype): cache}


def _reusable_static_cache(model: nn.Module, batch_size: int, length: int, device: torch.device):
    """A `StaticCache` for `model`, emptied, reused by every call with the same batch size, length bucket and
    autocast dtype, so the compiled decoding step keeps reading the same tensors (a new cache would mean a new
    CUDA graph); one cache per shape stays allocated with the model. Its tensors are created at the first forward,
    keys and values each in their own dtype (`_keep_value_dtype`). None where this version of transformers has no
    such `StaticCache` (then `generate` makes its own)."""
    try:
        from transformers import StaticCache
    except ImportError:  # pragma: no cover
        return None
    length = _cache_length(length)
    autocast = torch.is_autocast_enabled(device.type)
    dtype = torch.get_autocast_dtype(device.type) if autocast else None
    key = (batch_size, length, dtype)
    caches = _STATIC_CACHES.setdefault(model, {})
    if key not in caches:
        try:
            caches[key] = StaticCache(config=model.config, max_cache_len=length)
        except TypeError:  # an older signature
            return None
        for layer in getattr(caches[key], "layers", ()):
            _keep_value_dtype(layer)
    cache = caches[key]
    cache.reset()
    return cache


def _cache_length(length: int) -> int:
    """Static caches come in multiples of 64 tokens: few distinct shapes as prompt lengths vary, few compilations."""
    return -(-length // 64) * 64


def _keep_value_dtype(layer) -> None:
    """Make a static cache layer store values in their own dtype. Under autocast the keys leave the rotary
    embedding in float32 while the values stay bf16; transformers allocates both in the keys' dtype and then
    fails to copy the values in. The attention casts both anyway, so the numbers equal those of a dynamic cache."""
    allocate = getattr(layer, "lazy_initialization", None)
    if allocate is None:
        return

    def lazy_initialization(key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        allocate(key_states, value_states, *args, **kwargs)
        values = getattr(layer, "values", None)
        if isinstance(values, torch.Tensor) and values.dtype != value_states.dtype:
            layer.values = torch.zeros_like(values, dtype=value_states.dtype)
            torch._dynamo.mark_static_address(layer.values)

    layer.lazy_initialization = lazy_initialization


# generate() keyword arguments that plain sampling from softmax(logits / temperature) already satisfies.
_PLAIN_SAMPLING = {"do_sample": (True,), "top_k": (0, None), "top_p": (1.0, None), "min_length": (-1, 0, None)}


def resolve_backend(
    name: str, device: torch.device, deepspeed_stage: int | None, peft: bool, fsdp2: bool = False
) -> str:
    """The backend that 'auto' means here: 'compiled' on a CUDA device, unless the weights are partitioned by
    ZeRO-3 or sharded by FSDP2 (gathered afresh for each rollout, so a captured graph would read stale addresses)
    or the policy is a PEFT model (its adapters switch on and off around the reference forward); else 'kv_cache'."""
    if name != "auto":
        return name
    if device.type == "cuda" and deepspeed_stage != 3 and not fsdp2 and not peft:
        return "compiled"
    return "kv_cache"


def generation_backend(backend: str, generation_kwargs: dict, response_length: int, temperature: float, stop_token_id):
    """-> (sampling function, its keyword arguments) for a resolved `backend` name and `generate()`-style kwargs.

    `max_new_tokens`, `temperature` and `eos_token_id` (the stop token) override the run's settings; options
    that plain sampling already means (`do_sample=True`, `top_k=0`, `top_p=1.0`, `min_length=-1`, `pad_token_id`)
    are dropped; with any other option the sampling goes through `transformers`' `generate` even when `backend`
    is 'kv_cache'."""
    kwargs = dict(generation_kwargs)
    settings = {
        "response_length": kwargs.pop("max_new_tokens", response_length),
        "temperature": kwargs.pop("temperature", temperature),
        "stop_token_id": kwargs.pop("eos_token_id", stop_token_id),
    }
    kwargs.pop("pad_token_id", None)  # always the tokenizer's: the masks are built from it
    for name, no_op_values in _PLAIN_SAMPLING.items():
        if name in kwargs and kwargs[name] in no_op_values:
            kwargs.pop(name)
    if backend == "compiled_loop" and not kwargs:
        return sample_responses_compiled, settings
    if backend in ("compiled", "compiled_loop"):
        return functools.partial(generate_with_transformers, static_cache=True, **kwargs), settings
    if kwargs or backend == "generate":
        return functools.partial(generate_with_transformers, **kwargs), settings
    return sample_responses, settings


def draws_from_generator(sample) -> bool:
    """Whether a sampling function of `generation_backend` draws from a `generator=` it is given (this module's
    loops) rather than the process-wide one (transformers' `generate`, which takes none)."""
    return sample in (sample_responses, sample_responses_compiled)


def takes_generator(backend: str) -> bool:
    """`draws_from_generator` for the sampling a resolved `backend` name picks (no `generate()` options)."""
    return draws_from_generator(generation_backend(backend, {}, 1, 1.0, None)[0])

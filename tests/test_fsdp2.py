"""trl_ppo's FSDP2 pieces (`trl_ppo/fsdp.py`) on `torch.distributed.fsdp.fully_shard` directly, without accelerate:
two gloo processes on the CPU (torch.multiprocessing). The accelerate path itself runs in test_distributed.py.
"""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.distributed


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def counting_gathers() -> list[int]:
    """Count FSDP2's all-gathers (each gathers one unit's weights) from now on."""
    calls, gather = [0], torch.distributed.all_gather_single

    def counted(*args, **kwargs):
        calls[0] += 1
        return gather(*args, **kwargs)

    torch.distributed.all_gather_single = counted
    return calls


def shards_and_gathers(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        results[rank] = check_on_this_process()
    finally:
        torch.distributed.destroy_process_group()


def check_on_this_process() -> dict:
    import copy

    from torch.distributed.fsdp import OffloadPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    from trl_ppo import fsdp
    from trl_ppo.default_job import build_tiny_models, build_word_tokenizer
    from trl_ppo.logprobs import response_logprobs
    from trl_ppo.models import PolicyAndValueWrapper, decoder_blocks, freeze
    from trl_ppo.value_head import AutoModelForCausalLMWithValueHead

    tokenizer = build_word_tokenizer()
    policy, _ = build_tiny_models(tokenizer, hidden_size=32, seed=0)
    whole = freeze(copy.deepcopy(policy))
    torch.manual_seed(1)
    ids = torch.randint(3, len(tokenizer), (2, 10))
    mask = torch.ones_like(ids)
    plugin = SimpleNamespace(mixed_precision_policy=None, cpu_offload=OffloadPolicy())
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), device=torch.device("cpu"))
    result = {}

    # The reference: sharded per block, its backbone and head called one by one (chunked log-probs) in a root call.
    reference = fsdp.shard_frozen_model(freeze(copy.deepcopy(policy)), accelerator)
    result["ref_sharded"] = all(isinstance(p, DTensor) for p in reference.parameters())
    result["ref_local"] = sum(p.to_local().numel() for p in reference.parameters())
    result["ref_full"] = sum(p.numel() for p in reference.parameters())
    with torch.no_grad():
        expected = response_logprobs(whole, ids, mask, ids[:, -4:], 1.0, chunk_size=8).logprobs
        sharded = fsdp.root_call(reference, response_logprobs, ids, mask, ids[:, -4:], 1.0, chunk_size=8).logprobs
    result["ref_difference"] = (expected - sharded).abs().max().item()

    # The trained wrapper, sharded as accelerate does (blocks, then the root): `gathered` keeps the LM's units whole
    # through several forwards, then restores each unit's `reshard_after_forward`.
    wrapper = PolicyAndValueWrapper(AutoModelForCausalLMWithValueHead(policy), None)
    for block in decoder_blocks(wrapper):
        fully_shard(block, reshard_after_forward=True)
    fully_shard(wrapper)
    fsdp.enable_root_calls(wrapper)
    with torch.no_grad():  # the first forward makes the wrapper FSDP's root (the root keeps its weights after it)
        fsdp.root_call(wrapper, lambda module: module.lm(ids).logits)
    units = fsdp._units(wrapper)
    before = [fsdp._reshards_after_forward(unit) for unit in units]
    gathers = counting_gathers()
    with torch.no_grad(), fsdp.gathered(wrapper, wrapper.lm):
        result["gathered_whole"] = not any(isinstance(p, DTensor) for p in wrapper.lm.parameters())
        first = gathers[0]
        outputs = [fsdp.root_call(wrapper, lambda module: module.lm(ids).logits) for _ in range(3)]
        result["gathers_in_forwards"] = gathers[0] - first
    result["gathers_to_gather"] = first
    result["units"] = len(units)
    result["settings_restored"] = [fsdp._reshards_after_forward(unit) for unit in units] == before
    result["sharded_after"] = all(isinstance(p, DTensor) for p in wrapper.lm.parameters())
    with torch.no_grad():
        result["lm_difference"] = (outputs[0] - whole(ids).logits).abs().max().item()
        gathers[0] = 0
        fsdp.root_call(wrapper, lambda module: module.lm(ids).logits)  # sharded again: each block gathered anew
        result["gathers_after"] = gathers[0]
    return result


def test_sharded_reference_and_gathered_policy_on_two_processes():
    results = torch.multiprocessing.Manager().dict()
    torch.multiprocessing.spawn(shards_and_gathers, args=(free_port(), results), nprocs=2, join=True)
    for rank in (0, 1):
        result = results[rank]
        assert result["ref_sharded"] and 0.4 * result["ref_full"] < result["ref_local"] < 0.6 * result["ref_full"]
        assert result["ref_difference"] < 1e-6  # the same log-probs as the whole model
        assert result["gathered_whole"] and result["lm_difference"] < 1e-6
        assert result["units"] == 3  # two blocks and the root
        assert 0 < result["gathers_to_gather"] <= result["units"]  # once per unit
        assert result["gathers_in_forwards"] == 0  # three forwards, nothing gathered again
        assert result["settings_restored"], result
        assert result["sharded_after"], result
        assert result["gathers_after"] >= 2  # the blocks reshard after forward again

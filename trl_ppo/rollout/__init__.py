"""The rollout side: everything between the policy's weights and a filled `Rollout`.

* `record.py`: the `Rollout` record, one batch of episodes from sampling to the update.
* `generation.py`: the sampling backends (a KV-cache loop, transformers' `generate`, compiled variants).
* `collect.py`: one-turn rollouts: sample, then the log-probs and values the update needs.
* `turn_loop.py`: multi-turn episodes played in lockstep (tool calls parsed and answered between turns).
* `engine.py`: multi-turn episodes with continuous batching over their turns, KV caches kept across tool calls.
* `agreement.py`: the sampler's log-probs against the training forward's (`rollout/logprob_diff_*`).
* `asynchronous.py`: the sampler process of `max_staleness` (batches sampled ahead by an older policy version).

What it may touch: the models (read-only, under `torch.no_grad`), the tokenizer and chat templates (`agents.chat`),
and tool execution (`agents.execution`); never the optimizer, the loss or the trainer's state.
"""

from .collect import (
    Sampling,
    add_logprobs_and_values,
    collect_rollout,
    reference_output,
    sample_responses,
    sample_rollout,
)
from .record import PER_TOKEN_FIELDS, Rollout, chunks, masked_response_logprobs

__all__ = [
    "PER_TOKEN_FIELDS",
    "Rollout",
    "Sampling",
    "add_logprobs_and_values",
    "chunks",
    "collect_rollout",
    "masked_response_logprobs",
    "reference_output",
    "sample_responses",
    "sample_rollout",
]

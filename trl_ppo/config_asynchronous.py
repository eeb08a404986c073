"""`PPOConfig`'s fields of asynchronous PPO: how stale the episodes an update trains on may be, and the off-policy
correction that keeps the update right (mixed into it like `EstimatorConfig`). The sampler that runs ahead is
`rollout/asynchronous.py`'s, the corrections' weights `off_policy.py`'s, the update applies them (`update.py`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from .off_policy import CORRECTIONS


@dataclass
class AsyncConfig:
    """`max_staleness`, `off_policy_correction` and `tis_cap`."""

    max_staleness: int = field(
        default=0,
        metadata={
            "help": "0: synchronous PPO. k >= 1: a sampler process samples and scores the next k batches while the "
            "trainer trains; update u trains on episodes of the policy after update u-1-k. Needs "
            "`off_policy_correction`; one CPU process, no DeepSpeed or FSDP."
        },
    )
    off_policy_correction: str | None = field(
        default=None,
        metadata={
            "help": "PPO's ratio is always pi_theta / pi_prox, clipped around the policy the update starts from "
            "(its log-probs recomputed at training time); this names each token's weight: 'decoupled' (AReaL: "
            "pi_prox / pi_behav), 'tis' (that weight capped at `tis_cap`), 'mis' (that weight where it is at most "
            "`tis_cap`, 0 above: AReaL's behaviour-weight cap) or 'none' (1: the staleness ignored, the ablation). "
            "At `max_staleness=0` it corrects the sampler/trainer mismatch where the sampler records its "
            "log-probs (the agents' episode engine, `generation_backend='vllm'`)."
        },
    )
    tis_cap: float = field(
        default=2.0,
        metadata={
            "help": "C of 'tis' and 'mis': 'tis' weighs each token min(pi_prox / pi_behav, C); 'mis' drops a token "
            "whose pi_prox / pi_behav exceeds C (weight 0)."
        },
    )


def check_async_options(args, fail) -> None:
    """`max_staleness`, `off_policy_correction` and `tis_cap`, before any compute; `fail(message)` raises."""
    staleness, correction = args.max_staleness, args.off_policy_correction
    if staleness < 0:
        fail(f"`max_staleness` must be >= 0 (0: synchronous), got {staleness}.")
    if correction is not None and correction not in CORRECTIONS:
        fail(f"Unknown `off_policy_correction` {correction!r}: use one of {', '.join(map(repr, CORRECTIONS))}.")
    if not args.tis_cap >= 1.0:
        fail(f"`tis_cap` must be >= 1 (a cap below 1 would shrink even on-policy tokens), got {args.tis_cap}.")
    if staleness >= 1 and correction is None:
        fail(
            f"`max_staleness={staleness}` trains on episodes sampled by a policy {staleness} update(s) old: PPO's "
            "ratio is clipped around the policy the update starts from, and the episodes need a weight for the "
            "policy that sampled them. Set `off_policy_correction` to 'decoupled' (AReaL), 'tis' (truncated "
            "importance sampling) or 'mis' (masked importance sampling), or to 'none' to leave their staleness "
            "uncorrected (an ablation)."
        )
    if staleness >= 1 and correction == "none":
        warnings.warn(
            f"`max_staleness={staleness}` with `off_policy_correction='none'`: the episodes' staleness is not "
            "corrected for (the ablation); use 'decoupled', 'tis' or 'mis' to train on them safely.",
            stacklevel=3,
        )

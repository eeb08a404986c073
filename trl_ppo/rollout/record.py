"""The `Rollout` record: one batch of episodes carried from sampling to the update (prompts, responses, their
masks, and what scoring and the advantages add to it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .. import kl, ppo

# Per-token fields of a `Rollout`, each `[B, T]`: cut together by `trim_padding`.
PER_TOKEN_FIELDS = (
    "responses",
    "response_mask",
    "response_attention_mask",
    "logprobs",
    "ref_logprobs",
    "values",
    "full_kl",
    "advantages",
    "returns",
    "sampler_logprobs",
)


@dataclass
class Rollout:
    """One batch of episodes, from sampling to the update. `B` episodes, `Lq` prompt and `T` response tokens."""

    queries: torch.Tensor  # [B, Lq] left-padded prompt ids
    query_mask: torch.Tensor  # [B, Lq] True on prompt tokens
    responses: torch.Tensor  # [B, T] sampled ids, padding after the stop token
    response_mask: torch.Tensor  # [B, T] True on the tokens trained on: up to and including the stop token
    logprobs: torch.Tensor | None = None  # [B, T] log pi_old of each response token (INVALID_LOGPROB on padding)
    ref_logprobs: torch.Tensor | None = None  # [B, T] log pi_ref
    values: torch.Tensor | None = None  # [B, T] V(s_t) before each response token (0 on padding); None: no critic
    scores: torch.Tensor | None = None  # [B] sequence-level score, EOS penalty included
    full_kl: torch.Tensor | None = None  # [B, T] exact per-token KL(pi_old || pi_ref), with kl_penalty="full"
    advantages: torch.Tensor | None = None  # [B, T] whitened GAE advantages (set for the update)
    returns: torch.Tensor | None = None  # [B, T] value targets (set for the update; None without a critic)
    # [B, T] True on every response token, where `step(response_masks=...)` leaves some out of `response_mask`
    # (e.g. tool output): those are attended to but not trained on. None: the same as `response_mask`.
    response_attention_mask: torch.Tensor | None = None
    turn_rewards: torch.Tensor | None = None  # [B, K] per-turn rewards of multi-turn episodes (`agents`), or None
    # [B] bool: cut before their end (by the budget, `max_turns`, no room for the model); None where not known
    truncated: torch.Tensor | None = None
    # [B, T] log-prob of each model token under the sampler that drew it (INVALID_LOGPROB elsewhere): the episode
    # engine's, to measure how far the training forward's `logprobs` are from what was sampled; None: not recorded
    sampler_logprobs: torch.Tensor | None = None

    @property
    def response_length(self) -> int:
        """`T`, the width of `responses` (the longest response, or `response_length` when sampled here)."""
        return self.responses.size(1)

    @property
    def input_ids(self) -> torch.Tensor:
        """Prompt and response concatenated. `[B, Lq + T]`."""
        return torch.cat([self.queries, self.responses], dim=1)

    @property
    def attended_responses(self) -> torch.Tensor:
        """`[B, T]` True on every response token (padding excluded), trained on or not."""
        return self.response_mask if self.response_attention_mask is None else self.response_attention_mask

    @property
    def attention_mask(self) -> torch.Tensor:
        """Attention over the prompt tokens and the response tokens up to the stop token. `[B, Lq + T]`."""
        return torch.cat([self.query_mask, self.attended_responses], dim=1).long()

    def per_token_kl(self, penalty: str = "kl", estimator: str = "k1") -> torch.Tensor:
        """The KL term of the rewards `[B, T]` (`kl.per_token_kl` of the filled log-probs, or `full_kl` with
        `penalty="full"`), zero on padding."""
        mask = self.response_mask
        return kl.per_token_kl(self.logprobs, self.ref_logprobs, mask, penalty, estimator, self.full_kl)

    def with_advantages(self, advantages: ppo.Advantages) -> "Rollout":
        """The same episodes carrying `advantages` and `returns` (what the update reads per minibatch)."""
        return dataclasses.replace(self, advantages=advantages.advantages, returns=advantages.returns)

    def trim_padding(self) -> "Rollout":
        """The same episodes without the columns that are padding in all of them: prompt columns on the left,
        response columns after the longest response. Forward passes over it do less work for the same numbers
        (padded keys are masked out of attention, and causal attention never reads the columns on the right).
        Per-token fields become `[B, T']`; `ppo.pad_responses` widens results back to `T`."""
        first_prompt_column, width = torch.stack(
            [ppo.first_true_indices(self.query_mask.any(0)[None])[0], self.attended_responses.sum(1).amax()]
        ).tolist()  # one device-to-host sync
        fields = dict(vars(self), queries=self.queries[:, first_prompt_column:])
        fields["query_mask"] = self.query_mask[:, first_prompt_column:]
        for name in PER_TOKEN_FIELDS:
            if fields[name] is not None:
                fields[name] = fields[name][:, : max(width, 1)]
        return Rollout(**fields)

    def select(self, index: torch.Tensor | slice) -> "Rollout":
        """The episodes at `index` (a 1-D index tensor or a slice)."""
        return Rollout(**{name: None if value is None else value[index] for name, value in vars(self).items()})


def chunks(batch_size: int, chunk_size: int):
    """Slices covering `range(batch_size)` in pieces of at most `chunk_size`."""
    for start in range(0, batch_size, chunk_size):
        yield slice(start, min(start + chunk_size, batch_size))


def masked_response_logprobs(logprobs: torch.Tensor, rollout: Rollout) -> torch.Tensor:
    """Log-probs of the sampled response tokens `[B, T]` with INVALID_LOGPROB on padding."""
    return logprobs.masked_fill(~rollout.response_mask, ppo.INVALID_LOGPROB)

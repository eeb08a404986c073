"""`AgentRunner`: what `PPOTrainer` holds when it is given `tools` or `environment_factory`. Checked at
construction (before any compute); per update it starts one episode per prompt (its environment reset with the
row), plays the turns with the run's sampler (`turn_loop.run_turns`), and returns the `Rollout` with `logprobs`,
`ref_logprobs` and `values`, and the `env/` metrics of the episodes."""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping

import torch
from transformers.utils import logging

from .. import distributed as dist
from .. import ppo
from ..compat import cache_keyword
from ..config_checks import stop_and_penalty_tokens
from ..data import LeftPaddingCollator, check_fits_context, is_conversational, prompts_on_device
from ..deadlines import Deadlines, UserCallError
from ..fsdp import root_call
from ..models import context_length
from ..rewards import Reward
from ..rollout import Rollout, Sampling, add_logprobs_and_values, sample_responses
from ..rollout.agreement import agreement_metrics, agreement_sums
from ..rollout.collect import policy_sampling
from ..rollout.engine import CacheNotPlain, TurnLimits, play_episodes
from ..rollout.turn_loop import Episode, TurnSampler, episodes_rollout, run_turns
from ..rollout.vllm_episodes import play_on_engine
from .chat import ToolChat
from .environments import Environments, close_environments, environment_reward, make_environment
from .tools import schemas, tool_list, toolbox

logger = logging.get_logger(__name__)

ENVIRONMENT_REWARD = "environment"  # the name of the reward that `get_reward()` gives


def check_agent_config(args, tools, environment_factory, has_tools: bool | None = None) -> None:
    """Refuse `max_turns` / `max_tool_response_length` values that cannot work with the tools given. `has_tools`:
    whether the model has a tool to call (plain `tools`, or an environment's methods); default: any `tools` or
    environments given."""
    if args.max_turns < 1:
        raise ValueError(f"`max_turns` must be at least 1, got {args.max_turns}.")
    if args.max_tool_response_length is not None and args.max_tool_response_length < 1:
        raise ValueError(
            f"`max_tool_response_length` must be at least 1 (or None: no limit), got {args.max_tool_response_length}."
        )
    agentic = bool(tools) or environment_factory is not None
    has_tools = agentic if has_tools is None else has_tools
    if has_tools and args.max_turns < 2:
        raise ValueError(
            f"`tools` / `environment_factory` are given but `max_turns` is {args.max_turns}: the model's tool calls "
            "would never be answered. Set `max_turns` to 2 or more."
        )
    if not agentic and args.max_turns > 1:
        raise ValueError(
            f"`max_turns` is {args.max_turns} but there are no `tools` and no `environment_factory`: a turn after the "
            "first needs a tool answer. Pass `tools=` or `environment_factory=` to the trainer, or set `max_turns=1`."
        )
    engine = getattr(args, "generation_backend", None) == "vllm"  # records its log-probs of one-turn rollouts too
    if not agentic and not engine and getattr(args, "use_sampler_logprobs", False):
        raise ValueError(
            "`use_sampler_logprobs=True` takes the log-probs that the agents' episode engine (or the vLLM engine) "
            "records while it samples, and there are no `tools` and no `environment_factory`: one-turn sampling "
            f"records none with `generation_backend={getattr(args, 'generation_backend', None)!r}`. Leave it False, "
            "or sample with generation_backend='vllm'."
        )
    if not has_tools and args.max_turns > 1:
        raise ValueError(
            f"`max_turns` is {args.max_turns} but neither `tools` nor the environments' methods give the model a tool "
            "to call: each episode is one response. Set `max_turns=1`, or give the environment public methods."
        )


class AgentRunner:
    """Multi-turn episodes with `tools` (plain functions) and/or an `environment_factory`; see the module."""

    _lockstep = False  # True once the model's cache was found unfit for continuous batching (`rollout.engine`)

    def __init__(self, args, tokenizer, tools, environment_factory, stop_token_id: int | None, columns) -> None:
        self.tokenizer, self.tools = tokenizer, tool_list(tools or [])
        self.deadlines = Deadlines.from_config(args)  # on `reset`, `get_reward` and `close`
        self.use_sampler_logprobs = getattr(args, "use_sampler_logprobs", False)
        self.environments = None
        if environment_factory is not None:
            self.environments = Environments(environment_factory, columns, self.deadlines)
        makers = dict(environment_factory) if isinstance(environment_factory, Mapping) else {}
        makers = makers or ({None: environment_factory} if environment_factory is not None else {})
        shown = toolbox(self.tools)  # every tool any episode may have, from one probe instance of each environment
        self.has_environment_reward = False
        for name, maker in makers.items():
            where = "`environment_factory`" if name is None else f"`environment_factory[{name!r}]`"
            probe = self._probe_instance(maker, where)
            shown.update(toolbox(self.tools, probe))
            self.has_environment_reward |= callable(getattr(probe, "get_reward", None))
            close_environments([probe], self.deadlines.environment)
        check_agent_config(args, tools, environment_factory, has_tools=bool(shown))
        shipped = getattr(args, "tool_chat_template", None)
        if shipped is not None and not shown:
            raise ValueError(
                f"`tool_chat_template={shipped!r}` is set but the model has no tool to call (no `tools`, no "
                "environment methods): it would never be used. Unset it, or give the trainer tools."
            )
        # no tools: no parsing
        self.chat = ToolChat(tokenizer, schemas(shown), stop_token_id, shipped) if shown else None
        self.episodes: list[Episode] = []  # those of the latest rollout

    def _probe_instance(self, maker, where: str):
        """One instance of an environment, made to list its tools: bounded by `environment_timeout` and retried as
        the episodes' are (a factory that never returns would hang the trainer's construction)."""
        name = f"`{getattr(maker, '__name__', type(maker).__name__)}()` (the instance made to list its tools)"
        making = lambda: make_environment(maker, where)  # noqa: E731
        return self.deadlines.call(making, name, self.deadlines.environment, "environment_timeout")

    # ------------------------------------------------------------------------------------------ episodes
    def start_episodes(self, batch: dict, args, context: int | None) -> list[Episode]:
        """One episode per row of a collated batch: its environment made and reset with the row, its prompt
        rendered with its tools (chat-message prompts) and with the text `reset` returned, then fitted as the
        dataset's prompts were (`fit_query`): the tools and `reset`'s text made it longer."""
        columns = {key: value for key, value in batch.items() if key not in ("input_ids", "attention_mask")}
        episodes = []
        queries, query_mask = prompts_on_device(batch, "cpu", self.tokenizer.pad_token_id)
        made = []  # closed below if a later one fails
        try:
            for i, (ids, mask) in enumerate(zip(queries, query_mask)):
                row = {key: values[i] for key, values in columns.items()}
                environment, added = self.environments.create(row) if self.environments is not None else (None, None)
                made += [environment] if environment is not None else []
                tools = toolbox(self.tools, environment)
                query = self._prompt(ids[mask].tolist(), row.get("prompt"), tools, added)
                episodes.append(Episode(fit_query(query, args.max_prompt_length, args.response_length, context),
                                        tools, environment))
        except BaseException:  # the environments made so far hold sessions, sandboxes or files: release them
            close_environments(made, self.deadlines.environment)
            raise
        return episodes

    def _prompt(self, ids: list[int], prompt, tools, added: str | None) -> list[int]:
        """The episode's prompt ids: chat messages rendered again with the episode's tools, `reset`'s text added to
        the last message; plain text prompts (and chat prompts with nothing to add) as the dataset gave them."""
        if is_conversational(prompt) and (tools or added):
            messages = copy.deepcopy(list(prompt))
            if added:
                messages[-1]["content"] = f"{messages[-1]['content']}\n\n{added}"
            text = self.tokenizer.apply_chat_template(
                messages, tools=schemas(tools) or None, tokenize=False, add_generation_prompt=True,
                chat_template=None if self.chat is None else self.chat.chat_template,  # a swapped-in training copy
            )
            return self.tokenizer.encode(text, add_special_tokens=False)
        return ids + (self.tokenizer.encode(added, add_special_tokens=False) if added else [])

    def close_environments(self, batch: dict) -> None:
        """Close the environments of a scored batch (`environments.close_environments`)."""
        close_environments(batch.get("environments") or [], self.deadlines.environment)

    def collect(self, batch: dict, models, sampling: Sampling, args, behaviour_only: bool = False) -> Rollout:
        """Play one episode per prompt of `batch` -> its `Rollout`, with `logprobs`, `ref_logprobs` and `values`
        (`behaviour_only`: as `add_logprobs_and_values`). The batch gains an `environments` column (reward
        functions receive it)."""
        device, context = models.accelerator.device, context_length(models.wrapper.lm)
        start = functools.partial(self.start_episodes, batch, args, context)  # a failure stops every process
        episodes = dist.checked_on_every_process(start, device, "environments", (Exception,), "failed", UserCallError)
        self._play(episodes, models, sampling, args)
        batch["environments"] = [episode.environment for episode in episodes]
        self.episodes = episodes
        rollout = episodes_rollout(episodes, sampling.pad_token_id, args.response_length, device)
        return add_logprobs_and_values(rollout, models, args, behaviour_only=behaviour_only)

    def _play(self, episodes: list[Episode], models, sampling: Sampling, args) -> None:
        """Play the episodes to their end: on the vLLM engine (`sampling.engine`), else with continuous batching
        on the policy, else (asked for, or where sampling is a collective or the cache is not plain) in lockstep."""
        if sampling.engine is not None:
            play_on_engine(episodes, sampling.engine, self.chat, turn_limits(args, sampling), sampling.generator,
                           sampling.version)  # fmt: skip
            return
        device = models.accelerator.device
        sync = dist.weights_are_sharded(models.accelerator) and models.accelerator.num_processes > 1
        lockstep = sync or self._lockstep or args.agent_rollout == "lockstep"
        if not lockstep:
            try:
                self._play_continuous(episodes, models, sampling, args)
            except CacheNotPlain as reason:  # raised at the first prefill, before any token was drawn
                logger.warning(f"`agent_rollout='continuous'` needs a plain KV cache and {reason}: episodes are "
                               "played in lockstep instead.")
                lockstep = self._lockstep = True
        if lockstep:
            run_turns(
                episodes,
                turn_sampler(models, sampling),
                self.chat,
                args.max_turns,
                args.response_length,
                args.max_tool_response_length,
                tool_timeout=args.tool_timeout,
                any_process=(lambda flag: not dist.all_processes(not flag, device)) if sync else None,
                idle_context=[sampling.pad_token_id],
            )

    def _play_continuous(self, episodes: list[Episode], models, sampling: Sampling, args) -> None:
        """Play the episodes with continuous batching over their turns (`rollout.engine`)."""
        limits, wrapper = turn_limits(args, sampling), models.wrapper
        forward = lambda **inputs: root_call(wrapper, lambda module: module.lm(**inputs))  # noqa: E731
        with torch.no_grad(), policy_sampling(models, sampling):
            play_episodes(episodes, forward, models.accelerator.device, cache_keyword(wrapper.lm), self.chat, limits,
                          sampling.generator)  # fmt: skip

    # ----------------------------------------------------------------------------------- rewards, metrics
    def environment_reward(self) -> Reward | None:
        """The reward of the environments' `get_reward()` (None when no environment class has one)."""
        if not self.has_environment_reward:
            return None
        bounded = functools.partial(environment_rewards, deadlines=self.deadlines)
        return Reward(bounded, ENVIRONMENT_REWARD, own_deadlines=True)

    @torch.no_grad()
    def metrics(self, rollout: Rollout, accelerator) -> dict[str, float]:
        """`env/turns_mean`, `env/tool_calls_mean`, `env/turn_rewards_mean` (the sum of an episode's turn rewards:
        what its tools and environment paid along the way), per episode; `env/tool_errors` (failed calls this
        update), `env/tool_timeouts` (of those, calls stopped at `tool_timeout` seconds),
        `env/truncated_frac` (episodes cut by the budget or `max_turns`), `env/truncated_tool_responses` and
        `val/env_token_frac` (of the tokens after the prompts, those of tools and environments), over all
        processes; and with the sampler's log-probs (`agent_rollout='continuous'`), `rollout/logprob_diff_*`
        (`rollout.agreement`)."""
        episodes = self.episodes
        if rollout.turn_rewards is None:  # episodes given to `step()`, not played here
            return {}
        counts = [
            sum(e.turns for e in episodes),
            sum(e.tool_calls for e in episodes),
            sum(sum(e.turn_rewards) for e in episodes),
            sum(e.tool_errors for e in episodes),
            sum(e.tool_timeouts for e in episodes),
            sum(e.truncated for e in episodes),
            sum(e.truncated_answers for e in episodes),
            len(episodes),
            float((rollout.attended_responses & ~rollout.response_mask).sum()),
            float(rollout.attended_responses.sum()),
        ]
        total = accelerator.gather(torch.tensor([counts], dtype=torch.float64, device=accelerator.device)).sum(0)
        turns, calls, paid, errors, timeouts, truncated, cut, count, env_tokens, tokens = total.tolist()
        return {
            "env/turns_mean": turns / max(count, 1),
            "env/tool_calls_mean": calls / max(count, 1),
            "env/turn_rewards_mean": paid / max(count, 1),
            "env/tool_errors": errors,
            "env/tool_timeouts": timeouts,
            "env/truncated_frac": truncated / max(count, 1),
            "env/truncated_tool_responses": cut,
            "val/env_token_frac": env_tokens / max(tokens, 1),
        } | self._agreement(rollout, accelerator)

    def _agreement(self, rollout: Rollout, accelerator) -> dict[str, float]:
        """`rollout/logprob_diff_*` where every process recorded its sampler's log-probs (else nothing; nor where
        they stood in for the training forward's, `use_sampler_logprobs`: the difference would be 0 by construction)."""
        recorded = rollout.sampler_logprobs is not None and not self.use_sampler_logprobs
        if not dist.all_processes(recorded, accelerator.device):
            return {}
        sums = agreement_sums(rollout.sampler_logprobs, rollout.logprobs, rollout.response_mask)
        return agreement_metrics(accelerator.gather(sums[None]))


def fit_query(query: list[int], max_prompt_length: int | None, response_length: int, context: int | None) -> list[int]:
    """An episode's prompt cut to `max_prompt_length` (its end kept, as `data.fit_prompts` cuts the dataset's),
    checked to leave `response_length` positions of the model's context for the episode's turns."""
    if max_prompt_length is not None and len(query) > max_prompt_length:
        logger.warning_once(
            f"Prompts rendered with their tools (and the text of the environment's `reset`) grew beyond "
            f"`max_prompt_length` ({max_prompt_length}) and are cut to their last {max_prompt_length} tokens."
        )
        query = query[-max_prompt_length:]
    check_fits_context(len(query), response_length, context, f"An episode's prompt has {len(query)} tokens once "
                       "rendered with its tools (and the text of the environment's `reset`)")
    return query


def environment_rewards(
    prompts, completions, environments=None, deadlines: Deadlines | None = None, **columns
) -> list[float | None]:
    """Each episode's `environment.get_reward()`, bounded by `deadlines`; None (no score) where the batch has no
    environments (episodes that did not come from the turn loop: those given to `step()`)."""
    if environments is None:
        return [None] * len(completions)
    return [environment_reward(environment, deadlines) for environment in environments]


def turn_limits(args, sampling: Sampling) -> TurnLimits:
    """How long the run's episodes may go, and what their turns stop at."""
    return TurnLimits(args.max_turns, args.response_length, sampling.stop_token_id, sampling.temperature,
                      args.max_tool_response_length, args.tool_timeout)  # fmt: skip


def turn_sampler(models, sampling: Sampling) -> TurnSampler:
    """The run's sampler as `turn_loop.TurnSampler`: contexts left-padded, sampled in one call, each turn cut
    after its stop token."""
    collate = LeftPaddingCollator(sampling.pad_token_id)

    def sample_turn(contexts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        batch = collate([{"input_ids": context} for context in contexts])
        device = models.accelerator.device
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device).bool()
        responses = sample_responses(models, ids, mask, sampling, max_new_tokens=max_new_tokens)
        kept = ppo.response_mask_after_stop(responses, sampling.stop_token_id)
        return [row[keep].tolist() for row, keep in zip(responses, kept)]

    return sample_turn


def agent_runner(args, tokenizer, tools, environment_factory, rewards: list[Reward], train_dataset,
                 reward_model_given: bool = True):
    """The trainer's `AgentRunner`, or None for single-turn sampling (no tools, no environments, `max_turns=1`);
    the environments' `get_reward()` joins `rewards` as the reward named "environment" (it may be the only one).
    `reward_model_given`: whether `reward_model` was given (an empty list then needs a `get_reward`)."""
    if not tools and environment_factory is None:
        check_agent_config(args, tools, environment_factory)
        return None
    columns = None if train_dataset is None else list(train_dataset.column_names)
    stop_token_id = stop_and_penalty_tokens(args, tokenizer)[0]
    runner = AgentRunner(args, tokenizer, tools, environment_factory, stop_token_id, columns)
    reward = runner.environment_reward()
    if reward is not None:
        rewards.append(reward)
    elif environment_factory is not None and reward_model_given and not rewards:
        raise ValueError(
            "`reward_model` is an empty list and no environment of `environment_factory` defines `get_reward`: the "
            "episodes would have no score. Give a reward model or function, or a `get_reward()` method."
        )
    return runner

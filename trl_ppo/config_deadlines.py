"""The deadlines of the calls a run makes into user code, and their retries: fields that `PPOConfig` inherits (after
those of `OnPolicyConfig`, so that positional arguments keep their places). What happens at a deadline is
`deadlines.py`'s (reward functions, environments) and `agents/execution.py`'s (tools)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Each is > 0 seconds, or None for no limit (`config_fields.check_deadlines`).
DEADLINE_FIELDS = ("tool_timeout", "environment_timeout", "reward_timeout")


@dataclass
class DeadlineConfig:
    """Deadlines on tools, environments and reward functions, and the retries of the last two."""

    tool_timeout: float | None = field(
        default=300.0,
        metadata={
            "help": "Seconds a tool call may run (None: no limit). A call still running then is abandoned and "
            "answered as an error (counted in `env/tool_timeouts`), and the episode goes on. The default, 300, is "
            "far above what an interactive tool (a search, a sandboxed code run) takes, so only a hung call meets "
            "it, and it costs at most that per turn. Without a limit, a tool that never returns hangs the run. A "
            "sync tool runs in a thread of its own, stopped at the deadline at its next Python instruction; one "
            "blocked in C (a sleep, a socket) ends when that returns, and no healthy call waits for it."
        },
    )
    environment_timeout: float | None = field(
        default=300.0,
        metadata={
            "help": "Seconds an environment's `reset`, `get_reward` or `close` may run (None: no limit). Counted in "
            "`calls/timeouts`. `reset` (with making the environment; also the instance the trainer makes to list an "
            "environment's tools) and `get_reward` are then retried "
            "(`user_call_retries`) and at last stop the run with an error naming the method; a `close` is abandoned "
            "with a warning (a batch's closes run side by side, under one deadline). The default, 300, leaves room "
            "to start a sandbox or a remote episode."
        },
    )
    reward_timeout: float | None = field(
        default=300.0,
        metadata={
            "help": "Seconds a reward function may take to score one process's batch (None: no limit). Counted in "
            "`calls/timeouts`; sync or async. A sync function runs in the main thread and is interrupted there at "
            "the deadline (`signal` and math_verify's timeout work in it); it is then retried (`user_call_retries`) "
            "and at last the run stops with an error naming it, the update not applied. The default, 300, leaves "
            "room for an LLM judge over HTTP scoring a large batch, and with its retries (3 x 300 s + 3 s) stays "
            "within `ddp_timeout` (1800 s), as a run of several processes requires."
        },
    )
    user_call_retries: int = field(
        default=2,
        metadata={
            "help": "Retries of a reward function, `get_reward` or `reset` that timed out or failed transiently. "
            "Transient: `TimeoutError`, `ConnectionError`, or an exception whose class name says Timeout, Connect, "
            "Network or RateLimit, as those of HTTP clients do. Retries wait `user_call_backoff` seconds, doubled "
            "at each one (counted in `calls/retries`). When every try fails the run stops with an error naming the "
            "function; its last checkpoint is intact. Other errors stop the run at once. 0: no retry."
        },
    )
    user_call_backoff: float = field(
        default=1.0,
        metadata={
            "help": "Seconds before the first retry of `user_call_retries`; each next retry waits twice as long."
        },
    )

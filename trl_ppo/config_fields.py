"""Checks of each field's own value, run when a config is made (`PPOConfig.__post_init__`, and the legacy
`trl_ppo.legacy.PPOConfig`'s): its type, a finite number, and the numbers that scale a loss, a step or a score
within bounds. Checks that need several fields together, or the trainer, are in `config_checks.py`.

Every check reads fields by their `trl_ppo.PPOConfig` name; the legacy config passes `renamed` for the fields it
calls otherwise (`init_kl_coef` for `kl_coef`, ...), so each message names the field the user set.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing

from .config_deadlines import DEADLINE_FIELDS

SIMPLE_TYPES = (bool, int, float, str)

# numpy and torch seed their generators with an unsigned 32-bit integer.
SEED_RANGE = (0, 2**32 - 1)

# The largest loss coefficient or score penalty accepted: 1000 times the largest value in published recipes
# (coefficients 0.001 to 2, penalties about 1), and still far from where float32 overflows (a coefficient of
# 1e38 makes the loss's gradient infinite, and every weight NaN after one step).
MAX_COEFFICIENT = 1e3

# Below this temperature sampling is greedy to float precision already (a logit gap of 1e-4 becomes 100 nats; tests
# use 1e-6 for near-greedy runs), and a much smaller one only overflows: logits / 1e-45 are infinite, and torch then
# refuses to sample.
MIN_TEMPERATURE = 1e-6

# (field, lowest, highest, why): each bound inclusive, None for none; every value must also be finite.
BOUNDS = (
    ("learning_rate", 0.0, 1.0, "AdamW moves each weight by about `learning_rate` per step; usual: 1e-7 to 1e-3"),
    ("critic_learning_rate", 0.0, 1.0, "the value function's own AdamW rate; None: `learning_rate`"),
    ("weight_decay", 0.0, None, "usual: 0 to 0.1"),
    ("max_grad_norm", 0.0, None, "0 disables clipping; a negative norm reverses every update"),
    ("temperature", MIN_TEMPERATURE, None, "sampling is greedy to float precision below it; usual: 0.6 to 1.2"),
    ("missing_eos_penalty", 0.0, MAX_COEFFICIENT, "it is subtracted from the score; usual: about 1"),
    ("kl_coef", 0.0, MAX_COEFFICIENT, "usual: 0.01 to 0.5"),
    ("vf_coef", 0.0, MAX_COEFFICIENT, "usual: 0.1 to 1"),
    ("entropy_coef", 0.0, MAX_COEFFICIENT, "0: off; usual: 0.001 to 0.01"),
    ("kl_loss_coef", 0.0, MAX_COEFFICIENT, "0: off; usual: 0.001 to 0.1"),
    ("kl_horizon", 1.0, None, "in episodes; default 10000"),
    ("critic_warmup_steps", 0, None, "0: off"),
    ("user_call_retries", 0, 100, "0: no retry; each retry waits twice as long as the one before"),
    ("user_call_backoff", 0.0, 3600.0, "seconds before the first retry"),
)


@functools.cache
def simple_field_types(config_class: type) -> dict[str, tuple[type, bool]]:
    """{field: (its type, whether None is allowed)} for the fields of `config_class` typed `bool`, `int`, `float`
    or `str` (or one of them `| None`)."""
    simple = {}
    for name, hint in typing.get_type_hints(config_class).items():
        members = set(typing.get_args(hint)) if typing.get_origin(hint) in (typing.Union, types.UnionType) else {hint}
        kinds = members - {type(None)}
        if len(kinds) == 1 and next(iter(kinds)) in SIMPLE_TYPES:
            simple[name] = (next(iter(kinds)), type(None) in members)
    return simple


def check_field_types(config) -> None:
    """Refuse a value of the wrong type (`response_length="12"`, `seed="abc"`, `kl_coef=None`) naming the field,
    before any other check reads it: the command line converts types, Python callers and hand-made dicts may not."""
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    for name, (kind, optional) in simple_field_types(type(config)).items():
        value = getattr(config, name, None)
        article = "an" if kind is int else "a"
        expected = f"{article} {kind.__name__}{' or None' if optional else ''}"
        if value is None:
            if optional or defaults.get(name) is None:  # allowed, or the field's own default
                continue
            raise TypeError(f"`{name}` must be {expected}, got None: it has no 'off' value; its default is "
                            f"{defaults[name]!r}.")
        if kind is bool:
            fits = isinstance(value, bool)
        else:  # an int is a float too; a bool is neither
            fits = isinstance(value, (int, float) if kind is float else kind) and not isinstance(value, bool)
        if not fits:
            raise TypeError(f"`{name}` must be {expected}, got {value!r} ({type(value).__name__}).")


def check_finite_fields(config) -> None:
    """Refuse NaN and infinity in every float field: either makes every weight NaN after one update, or silently
    turns its option off (`kl_target=inf` only ever lowers the KL coefficient, `kl_horizon=inf` freezes it)."""
    for name, (kind, optional) in simple_field_types(type(config)).items():
        value = getattr(config, name, None)
        if kind is float and value is not None and not math.isfinite(value):
            instead = " (or None: off)" if optional else ""
            raise ValueError(
                f"`{name}` must be a finite number{instead}, got {value}: NaN or infinity makes every weight NaN, "
                "or silently switches its option off."
            )


def check_bounds(config, renamed: dict[str, str] | None = None) -> None:
    """The fields of `BOUNDS` that `config` has, within their bounds; `renamed` maps a `BOUNDS` name to the
    config's own name for it. Also `learning_rate * weight_decay` < 1 (and `critic_learning_rate`'s), `adam_epsilon`
    > 0 and the seeds."""
    renamed = renamed or {}
    for field, low, high, why in BOUNDS:
        name = renamed.get(field, field)
        value = getattr(config, name, None)
        if value is None:
            continue
        if low is not None and not value >= low:
            raise ValueError(f"`{name}` must be >= {low:g}, got {value} ({why}).")
        if high is not None and not value <= high:
            raise ValueError(f"`{name}` must be at most {high:g}, got {value} ({why}).")
    weight_decay = getattr(config, "weight_decay", None)
    for name in ("learning_rate", "critic_learning_rate"):
        learning_rate = getattr(config, name, None)
        if weight_decay is not None and learning_rate is not None and learning_rate * weight_decay >= 1:
            raise ValueError(
                f"`{name} * weight_decay` must be < 1 (AdamW shrinks every weight by that share per step), got "
                f"{learning_rate} * {weight_decay}: lower `weight_decay` (usual values: 0 to 0.1)."
            )
    if getattr(config, "adam_epsilon", 1.0) <= 0:
        raise ValueError(
            f"`adam_epsilon` must be > 0 (Adam divides by sqrt(v) + epsilon, 0 / 0 for a weight without gradient), "
            f"got {config.adam_epsilon}."
        )
    for name in ("seed", "data_seed"):
        value = getattr(config, name, None)
        if value is not None and not SEED_RANGE[0] <= value <= SEED_RANGE[1]:
            raise ValueError(f"`{name}` must be in [0, 2**32 - 1] (numpy and torch seeds), got {value}.")


def check_number_list(name: str, values, low: float, high: float) -> None:
    """`values` (a list or tuple of real numbers, each in [low, high]) or None; the error names the field."""
    if values is None:
        return
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"`{name}` must be a list of floats (one per reward) or None, got {values!r}.")
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"`{name}[{i}]` must be a float, got {value!r} ({type(value).__name__}).")
        if not (math.isfinite(value) and low <= value <= high):
            raise ValueError(f"`{name}[{i}]` must be a finite number in [{low:g}, {high:g}], got {value}.")


def check_interval_steps(config) -> None:
    """Refuse `save_steps`, `eval_steps` or `logging_steps` of 0 (or less) where their strategy is "steps"."""
    for strategy, steps in (
        ("save_strategy", "save_steps"),
        ("eval_strategy", "eval_steps"),
        ("logging_strategy", "logging_steps"),
    ):
        value = getattr(config, steps)
        if getattr(config, strategy) == "steps" and value is not None and not value > 0:
            raise ValueError(f"`{steps}` must be > 0 with `{strategy}='steps'`, got {value}.")


def check_deadlines(config) -> None:
    """The deadlines on calls into user code (`config_deadlines.py`) that `config` has: > 0 seconds, or None."""
    for name in DEADLINE_FIELDS:
        value = getattr(config, name, None)
        if value is not None and not 0 < value < math.inf:
            raise ValueError(f"`{name}` must be a finite number of seconds > 0 (or None: no limit), got {value}.")


def check_fields(config, renamed: dict[str, str] | None = None) -> None:
    """All of this module's checks of one config, types first."""
    check_field_types(config)
    check_deadlines(config)  # before `check_finite_fields`: infinity is not "no limit" here, None is
    check_finite_fields(config)
    check_bounds(config, renamed)
    check_number_list("reward_weights", getattr(config, "reward_weights", None), -MAX_COEFFICIENT, MAX_COEFFICIENT)

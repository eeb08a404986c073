"""The `trl-ppo` argument parser: a short `--help` with the sub-commands and PPO's own options first, grouped (every
option, full help texts, behind `--help-all`), and errors of one line that name the flag, where argparse and
`HfArgumentParser` would print a usage block of every option or a traceback."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import re

from transformers import HfArgumentParser, TrainingArguments
from transformers.hf_argparser import string_to_bool

from .config import PPOConfig
from .config_checks import validate_config
from .config_deadlines import DEADLINE_FIELDS
from .script_args import ModelConfig, ScriptArguments

USAGE = """trl-ppo [train] [--config FILE] [--OPTION VALUE ...]
       trl-ppo plot OUTPUT_DIR [--out FILE]
       trl-ppo env
       trl-ppo trajectories FILE
       trl-ppo trajectories view PATH [-o FILE.html] [--max_episodes N]"""
DESCRIPTION = """Train a causal LM with PPO.

sub-commands:
  train              the default: train, then save the policy to --output_dir; without --model_name_or_path,
                     the embedded default job (a tiny model on the shipped prompts, offline)
  plot OUTPUT_DIR    a PNG of a run's main curves (`trl-ppo plot --help`)
  env                versions and devices, for bug reports
  trajectories FILE  advantages and losses recomputed from a `trajectory_dir` file
  trajectories view PATH
                     a self-contained web page of a `trajectory_dir` (or file): its updates, episodes, and the
                     tokens coloured by advantage, value, return, value error or KL"""

# The sections of `--help`, in order: (title, option names). Options of `PPOConfig` that no section names (a new
# field) go to "other PPO options", so none is ever left out.
SECTIONS = (
    ("models and data", "model_name_or_path sft_model_path reward_model_path dataset_name dataset_config "
     "dataset_train_split dataset_test_split output_dir resume_from_checkpoint"),
    ("sampling", "response_length temperature stop_token stop_token_id missing_eos_penalty max_prompt_length "
     "generation_backend num_sample_generations"),
    ("batch layout", "total_episodes per_device_train_batch_size gradient_accumulation_steps num_mini_batches "
     "num_ppo_epochs local_rollout_forward_batch_size train_forward_batch_size logprobs_chunk_size"),
    ("PPO losses and advantages", "learning_rate advantage_estimator num_generations scale_rewards cliprange "
     "cliprange_value vf_coef value_head_init gamma lam gae_level whiten_rewards loss_agg_mode max_grad_norm"),
    ("the critic: how GAE's value function learns", "critic_learning_rate num_critic_epochs critic_warmup_steps "
     "critic_warmup_epochs lam_value"),
    ("KL to the reference", "kl_coef kl_estimator kl_penalty kl_target kl_horizon"),
    ("rewards", "reward_weights use_score_scaling use_score_norm score_clip"),
    ("the vLLM engine (generation_backend='vllm')", "vllm_gpu_memory_utilization vllm_kv_cache_gib "
     "vllm_max_model_len vllm_enforce_eager"),
    ("asynchronous PPO", "max_staleness off_policy_correction tis_cap"),
    ("agents: tools and environments", "max_turns max_tool_response_length tool_chat_template truncated_episodes "
     "agent_rollout use_sampler_logprobs"),
    ("deadlines on your code: tools, environments, reward functions", "tool_timeout environment_timeout "
     "reward_timeout user_call_retries user_call_backoff"),
    ("options from large-scale RL systems", "cliprange_low cliprange_high dual_clip entropy_coef "
     "length_adaptive_lam_alpha kl_loss_coef kl_loss_estimator"),
    ("stability guards", "early_stopping target_kl ratio_threshold skip_nonfinite_updates "
     "skip_zero_gradient_steps"),
    ("logging, saving, evaluation", "logging_steps report_to save_strategy save_steps save_value_model "
     "eval_strategy eval_steps seed trajectory_dir"),
    # newer transformers releases call `gradient_checkpointing` `activation_checkpointing`: whichever exists shows
    ("precision and devices", "bf16 fp16 use_cpu activation_checkpointing gradient_checkpointing "
     "ds3_gather_for_generation"),
)  # fmt: skip
# `PPOConfig`'s batch sizes that the trainer fills in (`config_checks.compute_batch_sizes`): only in `--help-all`.
DERIVED = (
    "world_size num_total_batches micro_batch_size local_batch_size batch_size local_mini_batch_size mini_batch_size"
)


def seconds_or_none(text: str) -> float | None:
    """A deadline's value on the command line: seconds, or `None` (no limit)."""
    return None if text.strip().lower() in ("none", "null") else float(text)


seconds_or_none.__name__ = "float"  # argparse names the type in its error: "invalid float value: 'abc'"
METAVARS = {int: "N", float: "X", string_to_bool: "BOOL", seconds_or_none: "X"}
# The first sentence of a help text: up to a full stop followed by a capital or a backtick ("e.g. GPT-2" is not one).
FIRST_SENTENCE = re.compile(r"^(.*?(?<!e\.g)(?<!i\.e)(?<!Dr)\.)\s+(?=[A-Z`'])", re.S)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """One spelling per option (`--total_episodes`; `--total-episodes` works too), defaults shown, the description
    as written (the sub-commands are a table) and, unless `full`, only the first sentence of each help text."""

    full = False

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        spellings = action.option_strings
        dashed_alias = {s for s in spellings if "-" in s[2:] and "--" + s[2:].replace("-", "_") in spellings}
        names = ", ".join(s for s in spellings if s not in dashed_alias)
        if action.nargs == 0:
            return names
        metavar = METAVARS.get(action.type, "VALUE") if action.metavar is None else action.metavar
        return f"{names} {self._format_args(action, metavar)}"

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        hidden = getattr(action, "hide_default", False)  # a default `trl-ppo` never uses (`cli.describe_model_paths`)
        if self.full:
            return text if hidden else super()._get_help_string(action)
        match = FIRST_SENTENCE.match(text)
        text = match.group(1) if match else text
        return text if hidden or action.default in (None, argparse.SUPPRESS) else f"{text} (default: %(default)s)"


class FullHelp(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        print(parser.format_help(full=True))
        parser.exit()


class CliParser(HfArgumentParser):
    """`HfArgumentParser` over `ScriptArguments`, `PPOConfig` and `ModelConfig`, with `--config FILE` and
    `--help-all`; its errors exit with one line."""

    def __init__(self) -> None:
        super().__init__(
            (ScriptArguments, PPOConfig, ModelConfig),
            prog="trl-ppo",
            usage=USAGE,
            description=DESCRIPTION,
        )
        self.add_argument("--help-all", nargs=0, action=FullHelp, help="Every option, with its whole help text.")
        self.add_argument(
            "--config",
            default=None,
            help="A YAML file of options: keys are the flag names without `--`; flags on the command line win.",
        )
        for action in self._actions:  # `--tool_timeout None` lifts a deadline
            if action.dest in DEADLINE_FIELDS:
                action.type = seconds_or_none

    def error(self, message: str):
        """argparse's errors (`--total_episodes abc`) in one line, without the usage block of every option."""
        raise SystemExit(f"trl-ppo: {message} (see `trl-ppo --help`).")

    def option_names(self) -> list[str]:
        """Each option's first spelling without `--` (`total_episodes`, `help-all`)."""
        return [action.option_strings[0][2:] for action in self._actions if action.option_strings[0].startswith("--")]

    def format_help(self, full: bool = False) -> str:
        formatter = HelpFormatter(self.prog)
        formatter.full = full
        formatter.add_usage(self.usage, [], [])
        formatter.add_text(self.description)
        for title, actions in self.sections(full):
            formatter.start_section(title)
            formatter.add_arguments(actions)
            formatter.end_section()
        if not full:
            shown = {action.dest for _, actions in self.sections(False) for action in actions}
            hidden = len({action.dest for _, actions in self.sections(True) for action in actions} - shown)
            formatter.add_text(f"{hidden} more options (transformers.TrainingArguments, LoRA, ...): trl-ppo --help-all")
        return formatter.format_help()

    def sections(self, full: bool) -> list[tuple[str, list[argparse.Action]]]:
        """(title, actions) of the help, PPO's options first; with `full`, every option, the derived sizes last."""
        by_dest: dict[str, list[argparse.Action]] = {}
        for action in self._actions:
            if not full and action.option_strings[:1] == [f"--no_{action.dest}"]:
                continue  # `--no_x`: the complement of `--x False`
            by_dest.setdefault(action.dest, []).append(action)
        trainer_fields = {f.name for f in dataclasses.fields(TrainingArguments)}
        ppo_fields = [f.name for f in dataclasses.fields(PPOConfig) if f.name not in trainer_fields]
        groups = [(title, names.split()) for title, names in SECTIONS]
        listed = {name for _, names in groups for name in names}
        derived = DERIVED.split()
        groups.append(("other PPO options", [n for n in ppo_fields if n not in listed and n not in derived]))
        groups.append(("script options", [f.name for f in dataclasses.fields(ScriptArguments) if f.name not in listed]))
        groups.append(("general", ["help", "help_all", "config"]))
        if full:
            groups.insert(-1, ("model loading, LoRA, quantisation (ModelConfig)", [
                f.name for f in dataclasses.fields(ModelConfig) if f.name not in listed]))  # fmt: skip
            taken = {name for _, names in groups for name in names} | set(derived)
            groups.append(("every other option (transformers.TrainingArguments)", [
                n for n in by_dest if n not in taken]))  # fmt: skip
            groups.append(("derived by the trainer (do not set)", derived))
        return [(title, [a for n in names for a in by_dest.get(n, [])]) for title, names in groups]

    def unknown_argument(self, argument: str) -> str:
        """The one-line message for an argument no option takes, with the closest option's name."""
        if not argument.startswith("-"):
            return f"trl-ppo: unexpected argument {argument!r}: options are `--name value` (see `trl-ppo --help`)."
        name = argument.split("=", 1)[0]
        hint = closest(name.lstrip("-").replace("-", "_"), self.option_names())
        return f"trl-ppo: unknown option {name}{f' (did you mean --{hint}?)' if hint else ''}; see `trl-ppo --help`."

    def parse_flags(self, argv: list[str]):
        """(script_args, training_args, model_args) of `argv`; a mistake exits with one line naming the flag."""
        namespace, unknown = self.parse_known_args(argv)
        if unknown:
            raise SystemExit(self.unknown_argument(unknown[0]))
        check_bf16_device(namespace)
        try:  # the config's checks, here before any model is loaded: each names its field, the value and the fix
            script_args, training_args, model_args, *_ = self.parse_args_into_dataclasses(args=argv)
            validate_without_warnings(training_args)
        except ValueError as error:
            raise SystemExit(f"trl-ppo: {error}") from None
        return script_args, training_args, model_args


def validate_without_warnings(training_args: PPOConfig) -> None:
    """`validate_config`'s errors; its warnings (`learning_rate=0`) come once, from the trainer."""
    checks_logger = logging.getLogger(validate_config.__module__)
    level = checks_logger.level
    checks_logger.setLevel(logging.ERROR)
    try:
        validate_config(training_args)
    finally:
        checks_logger.setLevel(level)


def closest(name: str, candidates) -> str | None:
    """The candidate a mistyped `name` most likely meant (`totl_episodes` -> `total_episodes`), or None."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def check_bf16_device(namespace: argparse.Namespace) -> None:
    """`--bf16 True` where no accelerator runs bf16: the flag and the fix, in place of `TrainingArguments`' "Your
    setup doesn't support bf16/gpu" traceback (same condition as its check)."""
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

    for flag in ("bf16", "bf16_full_eval"):
        if getattr(namespace, flag) and not namespace.use_cpu:
            if not (is_torch_bf16_gpu_available() or is_torch_xla_available()):
                raise SystemExit(
                    f"trl-ppo: --{flag} True: this machine has no GPU that runs bf16. Add --use_cpu True to train "
                    f"in bf16 on the CPU (autocast; often slower than float32 there), or leave out --{flag}."
                )

"""`--config FILE`: a YAML file's options as `trl-ppo` flags, placed before the command line's so that flags given
there win. Keys are flag names, checked against the parser's options (a typo gets the closest name)."""

from __future__ import annotations

import json
import os
import re

from .cli_parser import CliParser, closest


def with_config_file(argv: list[str]) -> list[str]:
    """`argv` with `--config FILE` replaced by the file's options, placed first so that later flags win."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg == "--config" or arg.startswith("--config="):
            path = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else None)
            if path is None:
                raise SystemExit("trl-ppo: `--config` needs a YAML file.")
            del argv[i : i + (1 if "=" in arg else 2)]
            return config_file_flags(path) + argv
    return argv


def _yaml_loader():
    """YAML 1.1's safe loader, except that only true/false are booleans: `eval_strategy: no` stays the string "no"
    (the option's value), not False."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), "tTfF"
    )
    return Loader


def config_file_flags(path: str) -> list[str]:
    """The options of a YAML file as flags: `learning_rate: 1e-5` -> `--learning_rate 1e-5`; a list gives several
    values, or one comma-joined value for an option that takes one (`report_to: [wandb, tensorboard]`); mappings
    are passed as JSON."""
    import yaml

    if not os.path.isfile(path):
        raise SystemExit(f"trl-ppo: the config file {path} does not exist.")
    with open(path, encoding="utf-8") as handle:
        try:
            options = yaml.load(handle, Loader=_yaml_loader()) or {}
        except yaml.YAMLError as error:  # file:line:column and the problem, not a traceback
            mark = getattr(error, "problem_mark", None)
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
            problem = getattr(error, "problem", None) or str(error)
            raise SystemExit(f"trl-ppo: {where}: malformed YAML: {problem}.") from None
    if not isinstance(options, dict):
        raise SystemExit(f"trl-ppo: {path} must hold a mapping of option names to values.")
    actions = {action.dest: action for action in CliParser()._actions}
    unknown = sorted(set(options) - set(actions))
    if unknown:
        named = [f"{key} (did you mean {hint}?)" if (hint := closest(key, actions)) else key for key in unknown]
        raise SystemExit(f"trl-ppo: unknown option(s) in {path}: {', '.join(named)} (see `trl-ppo --help`).")
    flags = []
    for key, value in options.items():
        if value is None:
            continue
        if isinstance(value, list):  # several values for a list option, else one comma-joined (`report_to`)
            many = actions[key].nargs in ("+", "*")
            flags += [f"--{key}", *(str(item) for item in value)] if many else [f"--{key}", ",".join(map(str, value))]
        elif isinstance(value, dict):
            flags += [f"--{key}", json.dumps(value)]
        else:
            flags += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return flags

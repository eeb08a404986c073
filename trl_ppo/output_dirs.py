"""Where `trl-ppo` writes, so that no run overwrites an earlier one by accident: the embedded job's new folder per
run when no `--output_dir` is given, and the refusal of an `--output_dir` that holds a finished run (the trainer
itself refuses a folder with checkpoints, `checkpoint.folders.checkpoint_to_resume`)."""

from __future__ import annotations

import os
import shlex
import time

from .checkpoint.folders import checkpoint_folders, is_auto
from .config import PPOConfig


def describe_output_dir(parser) -> None:
    """`--output_dir`'s help says what `trl-ppo` does without it, not `TrainingArguments`' default; and
    `--resume_from_checkpoint`'s, the values `trl-ppo` takes."""
    action = next(action for action in parser._actions if action.dest == "output_dir")
    action.help = (
        "Where the model, checkpoints and logs are written. None: the embedded job writes a new folder "
        "trl_ppo_default_run/<date>_<time> each run (resuming: the newest), a run with --model_name_or_path "
        "trainer_output/. A folder holding an earlier run is refused: resume it (--resume_from_checkpoint "
        "latest), pass --overwrite_output_dir, or choose another."
    )
    action = next(action for action in parser._actions if action.dest == "resume_from_checkpoint")
    action.help = (
        "`latest`, `auto` or a checkpoint folder. `latest` resumes the run in --output_dir from its newest "
        "checkpoint that verifies, refused where there is none; `auto` does the same where a checkpoint exists and "
        "else starts the run (for a job a cluster requeues with the same command)."
    )


def flag_given(argv: list[str], name: str) -> bool:
    """Whether `--name` (or its alias `--na-me`) is in `argv`."""
    flags = {f"--{name}", f"--{name.replace('_', '-')}"}
    return any(arg.split("=", 1)[0] in flags for arg in argv)


def default_run_folder(base: str, resume: bool) -> str:
    """The default job's `output_dir` when none is given: a new `<base>/<date>_<time>` folder for each run, so that
    running the demo again never overwrites an earlier run; when resuming, the newest one. Chosen on the main
    process and shared with the others (their clocks may read another second)."""
    from accelerate import PartialState

    state, chosen = PartialState(), [None]
    if state.is_main_process:
        earlier = sorted(os.listdir(base)) if os.path.isdir(base) else []
        name = time.strftime("%Y-%m-%d_%H-%M-%S")
        if resume and earlier:
            name = earlier[-1]
        elif name in earlier:  # two runs within a second
            name = next(f"{name}-{i}" for i in range(2, len(earlier) + 3) if f"{name}-{i}" not in earlier)
        chosen = [os.path.join(base, name)]
    if state.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(chosen)
    return chosen[0]


def check_output_dir(training_args: PPOConfig) -> None:
    """`trl-ppo` saves the trained model to `output_dir` at the end: refuse, before anything is loaded, a folder
    holding an earlier run's (its `trainer_state.json`, written at the end of every run), unless resuming or
    `--overwrite_output_dir` (`--resume_from_checkpoint auto` with no checkpoint there starts a fresh run: refused
    too). A folder with checkpoints is the trainer's to refuse, with its options."""
    output_dir, resume = training_args.output_dir, training_args.resume_from_checkpoint
    if (resume and not is_auto(resume)) or training_args.overwrite_output_dir or checkpoint_folders(output_dir):
        return
    if os.path.isfile(os.path.join(output_dir, "trainer_state.json")):
        raise SystemExit(
            f"trl-ppo: --output_dir {output_dir} holds an earlier run (its trained model and trainer_state.json): "
            "add --overwrite_output_dir to replace it, or choose another --output_dir."
        )


RUN_FOLDER_FLAGS = ("output_dir", "resume_from_checkpoint", "overwrite_output_dir")
BOOL_WORDS = ("true", "false", "yes", "no", "1", "0")


def resume_command(argv: list[str], output_dir: str) -> str:
    """The command that resumes this run, as the user typed it but with its folder spelled out: `--output_dir` the
    run's own (the default job's dated folder, or `make demo-real`'s, is another one at every start) and
    `--resume_from_checkpoint latest`. Under several processes, through `accelerate launch` with its own flags."""
    kept, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0][2:].replace("-", "_") if arg.startswith("--") else None
        if name in RUN_FOLDER_FLAGS:
            following = argv[i + 1] if i + 1 < len(argv) else None
            takes_value = name != "overwrite_output_dir" or (following or "").lower() in BOOL_WORDS
            skip = "=" not in arg and following is not None and takes_value
            continue
        kept.append(arg)
    flags = shlex.join([*kept, "--output_dir", output_dir, "--resume_from_checkpoint", "latest"])
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"accelerate launch <the same launch options> -m trl_ppo train {flags}"
    return f"trl-ppo train {flags}"

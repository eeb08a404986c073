"""`trl-ppo`: train with PPO from the command line.

    trl-ppo                       # the embedded default job: tiny model, shipped prompts, offline
    trl-ppo train --config run.yaml --learning_rate 1e-5   # YAML keys are flag names; flags given here win
    trl-ppo --model_name_or_path EleutherAI/pythia-1b-deduped --sft_model_path ... --reward_model_path ...
    trl-ppo plot OUTPUT_DIR       # PNG of the main curves from OUTPUT_DIR's trainer_state.json
    trl-ppo env                   # versions and devices, for bug reports
    trl-ppo trajectories FILE     # advantages and losses recomputed from a `trajectory_dir` file
    trl-ppo trajectories view DIR # a web page of a `trajectory_dir`: episodes, their tokens coloured by advantage
    trl-ppo --help                # the sub-commands and PPO's options, grouped; --help-all: every option

Without `--model_name_or_path` the default job runs (flags you pass still override its settings). Under several
processes: `accelerate launch [--config_file ...] -m trl_ppo train ...`.
"""

from __future__ import annotations

import os
import re
import sys

from .cli_parser import CliParser, closest
from .config import PPOConfig
from .config_file import with_config_file
from .output_dirs import check_output_dir, default_run_folder, describe_output_dir, flag_given, resume_command
from .script_args import (
    ModelConfig,
    ScriptArguments,
    get_kbit_device_map,
    get_peft_config,
    get_quantization_config,
    load_reward_function,
)

LOCAL_DATA_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def build_parser() -> CliParser:
    parser = CliParser()
    describe_output_dir(parser)
    describe_model_paths(parser)
    return parser


def describe_model_paths(parser) -> None:
    """`--sft_model_path` / `--reward_model_path` as `trl-ppo` uses them: their `PPOConfig` defaults (TRL's,
    EleutherAI/pythia-160m) are never what `trl-ppo` trains with (`check_model_flags`), so `--help` does not show
    them (`hide_default`); parsed, they keep them."""
    helps = {
        "sft_model_path": "The policy (and reference) to train, by default --model_name_or_path; a hub name or a "
        "local folder.",
        "reward_model_path": "The reward model (it also starts the value model), required with --model_name_or_path "
        "unless --reward_function gives the reward; a hub name or a local folder.",
    }
    for action in parser._actions:
        if action.dest in helps:
            action.help, action.hide_default = helps[action.dest], True


def parse(argv: list[str]):
    """(script_args, training_args, model_args, argv with the YAML file's options first) for `trl-ppo train`."""
    argv = with_config_file(argv)
    return (*build_parser().parse_flags(argv), argv)


def load_prompt_datasets(script_args: ScriptArguments, eval_samples: int = 100):
    """(train, eval) prompt datasets from a hub name or a local json/jsonl/parquet/csv file.

    The eval split is `dataset_test_split` when the dataset has it, else the last `eval_samples` rows of the
    training split (which are then left out of training).
    """
    from datasets import load_dataset

    name = script_args.dataset_name
    extension = os.path.splitext(name)[1].lower()
    if os.path.isfile(name):
        check_local_data_file(name, extension)
        splits = load_dataset(LOCAL_DATA_FORMATS[extension], data_files={"train": name})
    elif extension in LOCAL_DATA_FORMATS:
        raise SystemExit(f"trl-ppo: --dataset_name {name}: no such file.")
    else:
        check_model_source(name, "dataset_name", "a dataset folder or file")
        splits = load_dataset(name, name=script_args.dataset_config)
    if script_args.dataset_train_split not in splits:
        raise ValueError(
            f"Split {script_args.dataset_train_split!r} not found in {name!r} (splits: {list(splits)}): "
            "set `--dataset_train_split`."
        )
    train = splits[script_args.dataset_train_split]
    if script_args.dataset_test_split in splits:
        return train, splits[script_args.dataset_test_split]
    eval_samples = min(eval_samples, len(train) // 10)
    if eval_samples == 0:
        return train, None
    return train.select(range(len(train) - eval_samples)), train.select(range(len(train) - eval_samples, len(train)))


def check_local_data_file(path: str, extension: str) -> None:
    """Refuse, with the fix, a local prompts file that `datasets` cannot read: an unknown extension, or empty."""
    if extension not in LOCAL_DATA_FORMATS:
        raise SystemExit(
            f"trl-ppo: --dataset_name {path}: unknown file type {extension or '(no extension)'!r}; use one of "
            f"{', '.join(sorted(LOCAL_DATA_FORMATS))} (one prompt per row, in a `prompt` column)."
        )
    if os.path.getsize(path) == 0:
        raise SystemExit(f"trl-ppo: --dataset_name {path}: the file is empty; it needs one prompt per row.")


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")  # "name" or "org/name", as the hub allows


def check_model_source(value: str, flag: str, what: str = "a model folder") -> None:
    """A `--flag` value must be an existing local folder or a hub id (`org/name`): anything else (a mistyped path)
    fails here naming the flag, rather than inside `from_pretrained` with "Repo id must be in the form"."""
    if os.path.isdir(value) or (HUB_ID.match(value) and not value.startswith(".")):
        return
    raise SystemExit(f"trl-ppo: --{flag} {value}: no such folder (nor a hub id like `org/name`); give {what}.")


def check_model_flags(
    script_args: ScriptArguments, training_args: PPOConfig, model_args: ModelConfig, argv: list[str]
) -> None:
    """The model flags of `trl-ppo --model_name_or_path ...`, before anything is loaded: each path exists (or is a
    hub id), and the reward is named (`--reward_model_path` has a hub default from TRL's example, which would
    silently score with an untrained model), by a reward model or a reward function, not both. Without
    `--sft_model_path`, the policy is `--model_name_or_path` (not the field's hub default)."""
    given = {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}
    if script_args.reward_function is not None and "--reward_model_path" in given:
        raise SystemExit("trl-ppo: --reward_function and --reward_model_path are both given: choose one reward.")
    if script_args.reward_function is None and "--reward_model_path" not in given:
        raise SystemExit(
            "trl-ppo: --model_name_or_path needs --reward_model_path (the reward and value model to train against) "
            "or --reward_function. Without either the run would score with an untrained default model."
        )
    if "--sft_model_path" not in given:
        training_args.sft_model_path = model_args.model_name_or_path
    check_model_source(model_args.model_name_or_path, "model_name_or_path")
    check_model_source(training_args.sft_model_path, "sft_model_path")
    if script_args.reward_function is None:
        check_model_source(training_args.reward_model_path, "reward_model_path")


def check_resume_flag(training_args: PPOConfig) -> None:
    """`--resume_from_checkpoint` before any model is loaded: `latest` (or `true`) with no checkpoint in
    `--output_dir` that verifies, `auto` with checkpoints of which none verifies, or a folder that is not a whole
    checkpoint, exits with one line."""
    if training_args.resume_from_checkpoint is None or int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return  # one process per machine reads the checkpoint; the launcher stops the others if it exits
    from .checkpoint.folders import checkpoint_to_resume

    try:  # verified again by `train()`: a checkpoint damaged in between is still refused there
        checkpoint_to_resume(training_args.output_dir, training_args.resume_from_checkpoint)
    except ValueError as error:
        raise SystemExit(f"trl-ppo: {error}") from None


def load_models(training_args: PPOConfig, model_args: ModelConfig, reward_function=None):
    """(tokenizer, policy, ref_policy, value_model, reward_model) as in TRL's PPO example: the tokenizer from
    `model_name_or_path`, the policy (and its reference) from `sft_model_path`, value and reward models from
    `reward_model_path`. Each may be a hub name or a local folder. With a `reward_function`, it is the reward and
    the value model is None (a value head on the policy's backbone); a critic-free `advantage_estimator` has none."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from .estimators import uses_critic

    dtype = model_args.dtype if model_args.dtype in ("auto", None) else getattr(torch, model_args.dtype)
    quantization_config = get_quantization_config(model_args)
    model_kwargs = dict(
        revision=model_args.model_revision,
        attn_implementation=model_args.attn_implementation,
        dtype=dtype,
        device_map=get_kbit_device_map() if quantization_config is not None else None,
        quantization_config=quantization_config,
        trust_remote_code=model_args.trust_remote_code,
    )
    tokenizer = AutoTokenizer.from_pretrained(
        model_args.model_name_or_path, padding_side="left", trust_remote_code=model_args.trust_remote_code
    )
    if tokenizer.pad_token is None:
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    value_model, reward_model = None, reward_function
    if reward_function is None:  # the value model too, unless the estimator is critic-free
        critic = uses_critic(training_args.advantage_estimator)
        loaded = [
            AutoModelForSequenceClassification.from_pretrained(
                training_args.reward_model_path, num_labels=1, trust_remote_code=model_args.trust_remote_code
            )
            for _ in range(2 if critic else 1)
        ]
        value_model, reward_model = loaded[0] if critic else None, loaded[-1]
    policy = AutoModelForCausalLM.from_pretrained(training_args.sft_model_path, **model_kwargs)
    ref_policy = None
    if not model_args.use_peft:
        ref_policy = AutoModelForCausalLM.from_pretrained(training_args.sft_model_path, **model_kwargs)
    for model in (policy, ref_policy, value_model, reward_model):
        if isinstance(model, torch.nn.Module) and model.get_input_embeddings().num_embeddings < len(tokenizer):
            model.resize_token_embeddings(len(tokenizer))
    return tokenizer, policy, ref_policy, value_model, reward_model


def prompt_datasets(script_args: ScriptArguments):
    """(train, eval) prompts: `--dataset_name` when given, else the prompts shipped with trl_ppo."""
    from accelerate import PartialState

    from .default_job import default_prompts

    with PartialState().local_main_process_first():
        if script_args.dataset_name:
            return load_prompt_datasets(script_args)
        split = default_prompts().train_test_split(test_size=16, seed=0)
        return split["train"], split["test"]


def train_and_save(
    training_args, model_args, tokenizer, policy, ref_policy, reward, value_model, datasets, dataset_name=None,
    command: list[str] = (),
) -> None:
    """Train, save the policy (with its model card) to `output_dir`, then show the final completions table. A
    SIGTERM/SIGINT at the end of training or during the save lets the save finish and exits with status 0
    (`PPOTrainer.train`, `save_model`); during the table, it ends the table, not the process. `command`: the
    flags `trl-ppo train` was given, for the command that resumes a run stopped by a signal."""
    from .checkpoint import CheckpointOfAnotherRunError, PreemptionHandler
    from .checkpoint.identity import CheckpointOfOtherSettingsError
    from .deadlines import UserCallError
    from .reward_functions import RewardValueError
    from .trainer import PPOTrainer

    train_dataset, eval_dataset = datasets
    try:  # the trainer's checks of data, models and config, before any compute: one line each, as for flags
        trainer = PPOTrainer(
            args=training_args,
            processing_class=tokenizer,
            model=policy,
            ref_model=ref_policy,
            reward_model=reward,
            value_model=value_model,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            peft_config=get_peft_config(model_args),
        )
    except ValueError as error:
        raise SystemExit(f"trl-ppo: {error}") from None
    trainer.model_card_dataset = dataset_name or "the prompts shipped with trl_ppo"
    trainer.resume_hint = f"this command:\n  {resume_command(list(command), training_args.output_dir)}"
    # A refused resume, a reward that never answered or returned what cannot be scores: the message says it all (a
    # bug in a reward function keeps its traceback).
    refusals = (CheckpointOfAnotherRunError, CheckpointOfOtherSettingsError, UserCallError, RewardValueError)
    try:
        trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    except refusals as error:
        raise SystemExit(f"trl-ppo: {error}") from None
    # From the save on, a signal ends nothing early: the run has finished. Under one handler, so that none lands
    # between the save and the table with the default handler (status 143 instead of 0; found by the probe).
    with PreemptionHandler():
        trainer.save_model(training_args.output_dir)  # first: nothing after it can cost the trained model
        if trainer.is_world_process_zero():
            print(f"Saved the trained policy to {os.path.abspath(training_args.output_dir)}")
        if trainer.stop_signal is None:
            trainer.generate_completions()


def run_default_job(argv: list[str], command: list[str] = ()) -> None:
    """Train the tiny embedded policy with the sentiment reward, or `--reward_function` (on the shipped prompts by
    default), into a new folder under `trl_ppo_default_run/` unless `--output_dir` is given."""
    from . import default_job
    from .estimators import uses_critic

    if not flag_given(argv, "output_dir"):
        base = default_job.DEFAULT_JOB_SETTINGS["output_dir"]
        argv = [*argv, "--output_dir", default_run_folder(base, flag_given(argv, "resume_from_checkpoint"))]
    script_args, training_args, model_args = build_parser().parse_flags(default_job.DEFAULT_JOB_FLAGS + argv)
    for flag in ("reward_model_path", "sft_model_path"):  # the embedded job has its own models: refuse, not ignore
        if flag_given(argv, flag):
            raise SystemExit(
                f"trl-ppo: --{flag} needs --model_name_or_path (the policy and tokenizer to train); without it "
                "`trl-ppo` trains its embedded tiny job, which would not use it."
            )
    reward = default_job.sentiment_reward  # or the user's own, scoring the embedded job's responses
    if script_args.reward_function is not None:
        reward = load_reward_function(script_args.reward_function)
    check_output_dir(training_args)
    check_resume_flag(training_args)
    tokenizer = default_job.build_word_tokenizer()
    policy, value_model = default_job.build_tiny_models(tokenizer)
    value_model = value_model if uses_critic(training_args.advantage_estimator) else None  # critic-free: none
    train_and_save(
        training_args,
        model_args,
        tokenizer,
        policy,
        None,
        reward,
        value_model,
        prompt_datasets(script_args),
        script_args.dataset_name,
        command,
    )


def run_from_models(
    script_args: ScriptArguments, training_args: PPOConfig, model_args: ModelConfig, command: list[str] = ()
) -> None:
    """Train models given by path/hub name on a prompt dataset (the TRL example's flow)."""
    reward_function = script_args.reward_function and load_reward_function(script_args.reward_function)
    tokenizer, policy, ref_policy, value_model, reward_model = load_models(training_args, model_args, reward_function)
    train_and_save(
        training_args,
        model_args,
        tokenizer,
        policy,
        ref_policy,
        reward_model,
        value_model,
        prompt_datasets(script_args),
        script_args.dataset_name,
        command,
    )


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and not argv[0].startswith("-") else "train"
    if argv[:1] == [command]:
        argv = argv[1:]
    if command == "env":
        from .reporting import print_environment

        print_environment()
    elif command == "plot":
        from .reporting import plot_command

        plot_command(argv)
    elif command == "trajectories" and argv[:1] == ["view"]:
        from .viewer import view_command

        view_command(argv[1:])
    elif command == "trajectories":
        from .trajectories import trajectories_command

        trajectories_command(argv)
    elif command == "train":
        from .cpu_threads import set_cpu_threads

        typed = argv
        script_args, training_args, model_args, argv = parse(argv)  # --help and bad flags end here, before any line
        set_cpu_threads()
        if model_args.model_name_or_path is None:
            run_default_job(argv, typed)
        else:
            check_model_flags(script_args, training_args, model_args, argv)
            check_output_dir(training_args)
            check_resume_flag(training_args)
            run_from_models(script_args, training_args, model_args, typed)
    else:
        hint = closest(command, ("train", "plot", "env", "trajectories"))
        raise SystemExit(
            f"trl-ppo: unknown command {command!r}{f' (did you mean `{hint}`?)' if hint else ''}: use `train` "
            "(the default), `plot`, `env` or `trajectories`."
        )


if __name__ == "__main__":
    main()

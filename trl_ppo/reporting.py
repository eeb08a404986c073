"""What a run leaves for people: the curves as a PNG, a model card, and the environment for bug reports."""

from __future__ import annotations

import json
import os
import platform

from transformers.trainer_callback import PrinterCallback, ProgressCallback
from transformers.utils import logging

logger = logging.get_logger(__name__)

# (panel title, metrics drawn in it): the curves a PPO practitioner reads first.
CURVES = (
    ("score", ("objective/scores", "eval_objective/scores")),
    ("RLHF reward", ("objective/rlhf_reward",)),
    ("KL to the reference", ("objective/kl", "eval_objective/kl")),
    ("entropy", ("objective/entropy",)),
    ("value loss", ("loss/value_avg",)),
    ("clip fractions", ("policy/clipfrac_avg", "val/clipfrac_avg")),
    ("episodes/s", ("eps",)),
    ("response length", ("val/mean_response_length", "eval_val/mean_response_length")),
)
PLOT_FILE = "training_curves.png"
PLOT_SIZE = (1600, 800)  # pixels: 4 x 2 panels


def read_log_history(output_dir: str) -> list[dict]:
    """The logged entries of a run: `trainer_state.json` in `output_dir`, else in its newest complete checkpoint."""
    from .checkpoint import latest_checkpoint

    candidates = [os.path.join(output_dir, "trainer_state.json")]
    checkpoint = latest_checkpoint(output_dir)
    if checkpoint is not None:
        candidates.append(os.path.join(checkpoint, "trainer_state.json"))
    for path in candidates:
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as handle:
                return json.load(handle).get("log_history", [])
    raise FileNotFoundError(f"No trainer_state.json in {output_dir} or its checkpoints: is it a trl_ppo output_dir?")


def plot_curves(log_history: list[dict], path: str, title: str = "") -> str:
    """Draw the main PPO curves against episodes into a PNG of `PLOT_SIZE` pixels at `path`. Returns `path`."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    dpi = 100
    figure, axes = plt.subplots(2, 4, figsize=(PLOT_SIZE[0] / dpi, PLOT_SIZE[1] / dpi), dpi=dpi)
    for ax, (panel, names) in zip(axes.flat, CURVES):
        for name in names:
            points = [(entry["episode"], entry[name]) for entry in log_history if name in entry and "episode" in entry]
            if points:
                ax.plot(*zip(*points), marker="." if len(points) < 30 else None, label=name)
        ax.set_title(panel)
        ax.set_xlabel("episode")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=dpi)
    plt.close(figure)
    return path


def plot_command(argv: list[str]) -> None:
    """`trl-ppo plot OUTPUT_DIR [--out FILE]`."""
    import argparse

    parser = argparse.ArgumentParser(prog="trl-ppo plot", description="PNG of a run's main PPO curves.")
    parser.add_argument("output_dir", help="The run's output_dir (or one of its checkpoints).")
    parser.add_argument("--out", default=None, help=f"The PNG to write (default: OUTPUT_DIR/{PLOT_FILE}).")
    args = parser.parse_args(argv)
    try:
        history = read_log_history(args.output_dir)
    except FileNotFoundError as error:
        raise SystemExit(f"trl-ppo plot: {error}") from None
    path = plot_curves(history, args.out or os.path.join(args.output_dir, PLOT_FILE), os.path.basename(args.output_dir))
    print(f"Wrote {path}")


def environment() -> dict[str, str]:
    """Versions of the libraries a PPO run depends on, and the devices."""
    from importlib import metadata

    info = {
        "trl_ppo": metadata.version("trl_ppo"),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    for package in ("torch", "transformers", "accelerate", "datasets", "deepspeed", "peft", "wandb", "tensorboard"):
        try:
            info[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            info[package] = "not installed"
    import torch

    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["device"] = f"{len(names)} x {names[0]} (CUDA {torch.version.cuda})"
    else:
        info["device"] = f"CPU ({os.cpu_count()} cores), no CUDA device"
    return info


def print_environment() -> None:
    for key, value in environment().items():
        print(f"- {key}: {value}")


def model_card(
    base_model: str,
    dataset: str,
    rewards: list[str],
    hyperparameters: dict,
    final_metrics: dict,
    plot_file: str | None,
) -> str:
    """The README.md of a saved policy (Markdown with a YAML header, as the Hugging Face hub reads it)."""
    header = ["---", "library_name: transformers", "tags:", "- trl_ppo", "- ppo", "- rlhf"]
    if base_model and not os.path.exists(base_model):  # a hub id, not a local folder
        header.append(f"base_model: {base_model}")
    header.append("---")
    lines = [
        *header,
        "",
        "# A policy trained with PPO (trl_ppo)",
        "",
        f"- **Base model:** {base_model or 'a model built from a config (no pretrained weights)'}",
        f"- **Prompts:** {dataset}",
        f"- **Reward(s):** {', '.join(rewards)}",
        "",
        "## Hyper-parameters",
        "",
        "| name | value |",
        "|---|---|",
        *(f"| `{key}` | {value} |" for key, value in hyperparameters.items()),
        "",
        "## Final metrics",
        "",
        "| metric | value |",
        "|---|---|",
        *(
            f"| `{key}` | {value:.4g} |" if isinstance(value, float) else f"| `{key}` | {value} |"
            for key, value in final_metrics.items()
        ),
        "",
    ]
    if plot_file:
        lines += ["## Training curves", "", f"![training curves]({plot_file})", ""]
    lines += [
        "## Use it",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        'model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")',
        'tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")',
        'inputs = tokenizer("Your prompt", return_tensors="pt")',
        "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=32)[0]))",
        "```",
        "",
    ]
    return "\n".join(lines)


def show_progress(callbacks: list, metrics: dict) -> None:
    """Episodes, episodes/s, score and KL of the last update beside the progress bar (`ProgressCallback`'s)."""
    for callback in callbacks:
        bar = getattr(callback, "training_bar", None)
        if bar is not None:
            bar.set_postfix(
                episode=metrics["episode"],
                eps=f"{metrics['eps']:.3g}",
                score=f"{metrics['objective/scores']:.3g}",
                kl=f"{metrics['objective/kl']:.3g}",
            )


def log_line(logs: dict) -> str:
    """A log as printed in the terminal: floats to 4 significant digits, printed as numbers (transformers' own
    callbacks print them as quoted strings, `'objective/kl': '0.4666'`, beside unquoted ints)."""
    shown = {key: float(f"{value:.4g}") if isinstance(value, float) else value for key, value in logs.items()}
    shown.pop("total_flos", None)
    return str(shown)


class ProgressLogLines(ProgressCallback):
    """transformers' progress bar, its log lines written by `log_line`."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None:
            self.training_bar.write(log_line(logs or {}))


class PrintedLogLines(PrinterCallback):
    """transformers' printer of logs (`disable_tqdm=True`), its lines written by `log_line`."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_local_process_zero and logs is not None:
            print(log_line(logs))


def numeric_log_lines(trainer) -> None:
    """Swap the trainer's default progress bar or printer (exactly those classes) for the ones of `log_line`."""
    for default, replacement in ((ProgressCallback, ProgressLogLines), (PrinterCallback, PrintedLogLines)):
        found = [callback for callback in trainer.callback_handler.callbacks if type(callback) is default]
        for callback in found:
            trainer.remove_callback(callback)
            trainer.add_callback(replacement)


def warn_on_failure(what: str, write, *args) -> bool:
    """`write(*args)`, a report (curves, model card) beside the trained model; a failure of it (a full disk,
    a plotting error) is a warning, never the loss of the run. -> whether it was written."""
    try:
        write(*args)
        return True
    except Exception as error:  # noqa: BLE001 - whatever went wrong, the model matters more than its report
        logger.warning(f"Could not write {what}: {type(error).__name__}: {error}. The model is not affected.")
        return False


def save_run_log(output_dir: str, state) -> None:
    """The run's `trainer_state.json` (every logged metric) and its curves, for `trl-ppo plot` and people."""
    os.makedirs(output_dir, exist_ok=True)
    state.save_to_json(os.path.join(output_dir, "trainer_state.json"))
    plot_curves(state.log_history, os.path.join(output_dir, PLOT_FILE))

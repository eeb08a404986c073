"""The probe's shared constants and records (`Case`, `Result`), and two of its sections of cases: reward functions
(`REWARDS`) and files and signals (`FILES`). The probe, its outcomes and its command line: `probe.py`; the
environment and tool cases: `probe_agents.py`. This module imports neither (no import cycle)."""

from __future__ import annotations

import dataclasses
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
TRL_PPO = [PYTHON, "-m", "trl_ppo"]
OUTCOMES = ("handled", "finished, unseen", "stopped, named", "stopped, traceback", "hung", "lost")
# For user code that is no misbehaviour (`Case.works`): the run finished and every piece of evidence that the code
# did its work is seen, or the run finished without it.
WORK_OUTCOMES = ("worked", "finished, not worked")
DEADLINE = 2.0  # every deadline under test
RETRIES = 1
BACKOFF = 0.5
LOOP_GRACE = 5.0  # deadlines.LOOP_GRACE: a blocked event loop is given up this long after the deadline
START = 45.0  # seconds a tiny run takes without misbehaviour, with room for a loaded machine
SMALL = [f"--reward_timeout={DEADLINE:g}", f"--tool_timeout={DEADLINE:g}", f"--environment_timeout={DEADLINE:g}",
         f"--user_call_retries={RETRIES}", f"--user_call_backoff={BACKOFF:g}"]  # fmt: skip
# The default job, tiny: 3 updates of 8 episodes, 8 tokens, 1 PPO epoch, a log line per update.
TINY = ["--total_episodes", "24", "--per_device_train_batch_size", "8", "--num_ppo_epochs", "1",
        "--response_length", "8", "--num_sample_generations", "0", "--logging_steps", "1", "--report_to", "none",
        *SMALL]  # fmt: skip
CALL_BOUND = (RETRIES + 1) * DEADLINE + BACKOFF  # one call that times out on every try
NOTES = "my_notes.txt"  # a file of the user's in the output folder: it must survive every case


@dataclasses.dataclass
class Case:
    name: str
    kind: str
    culprit: str  # the text that names the culprit in a message (the function, method or file)
    setup: Callable[[Path], dict]  # case folder -> {"command": argv, "output_dir": Path, ...}
    bound: float = 0.0  # the documented deadlines the case may spend, on top of START
    evidence: tuple[str, ...] = ()  # metric names (in trainer_state.json) or texts in the output that show it
    bug: bool = False  # the culprit is a bug in user code: a traceback into it is wanted
    works: bool = False  # no misbehaviour: rc 0 with every `evidence` seen is `worked` (WORK_OUTCOMES)
    note: str = ""


@dataclasses.dataclass
class Result:
    case: Case
    outcome: str
    seconds: float
    last_line: str
    detail: str = ""


# ------------------------------------------------------------------------------------------------ reward functions
def reward_file(folder: Path, body: str) -> str:
    path = folder / "reward.py"
    path.write_text(textwrap.dedent(body))
    return f"{path}:probe"


def cli_case(body: str, *extra: str):
    """A CLI case: the default job, tiny, with the reward function `probe` defined by `body`."""

    def setup(folder: Path) -> dict:
        output = folder / "out"
        output.mkdir()
        (output / NOTES).write_text("mine\n")
        command = [*TRL_PPO, "train", *TINY, "--reward_function", reward_file(folder, body), "--output_dir",
                   str(output), *extra]  # fmt: skip
        return {"command": command, "output_dir": output}

    return setup


REWARDS = [
    Case("reward_hangs", "reward", "probe", cli_case("""
        import threading
        def probe(prompts, completions, **kw):
            threading.Event().wait()
        """), bound=CALL_BOUND),
    Case("reward_hangs_once", "reward", "probe", cli_case("""
        import threading, os
        def probe(prompts, completions, **kw):
            flag = os.path.join(os.path.dirname(__file__), "hung")
            if not os.path.exists(flag):
                open(flag, "w").close()
                threading.Event().wait()
            return [1.0] * len(completions)
        """), bound=CALL_BOUND, evidence=("calls/timeouts", "calls/retries")),
    Case("reward_slow_within_deadline", "reward", "probe", cli_case("""
        import time
        def probe(prompts, completions, **kw):
            time.sleep(1.0)
            return [1.0] * len(completions)
        """), bound=3.0, note="not a misbehaviour: 1 s under a 2 s deadline must pass unnoticed"),
    Case("reward_connection_error", "reward", "probe", cli_case("""
        def probe(prompts, completions, **kw):
            raise ConnectionError("judge unreachable")
        """), bound=CALL_BOUND),
    Case("reward_timeout_error_once", "reward", "probe", cli_case("""
        import os
        def probe(prompts, completions, **kw):
            flag = os.path.join(os.path.dirname(__file__), "failed")
            if not os.path.exists(flag):
                open(flag, "w").close()
                raise TimeoutError("judge busy")
            return [1.0] * len(completions)
        """), bound=CALL_BOUND, evidence=("calls/retries",)),
    Case("reward_raises_bug", "reward", "probe", cli_case("""
        def probe(prompts, completions, **kw):
            raise ValueError("a bug in my reward")
        """), bug=True),
    Case("reward_nan", "reward", "probe", cli_case("""
        def probe(prompts, completions, **kw):
            return [float("nan")] * len(completions)
        """)),
    Case("reward_inf", "reward", "probe", cli_case("""
        def probe(prompts, completions, **kw):
            return [float("inf")] + [0.0] * (len(completions) - 1)
        """)),
    Case("reward_wrong_length", "reward", "probe", cli_case("""
        def probe(prompts, completions, **kw):
            return [1.0] * (len(completions) - 1)
        """)),
    Case("reward_returns_none", "reward", "probe", cli_case("""
        def probe(prompts, completions, **kw):
            return None
        """)),
    Case("reward_all_none_scores", "reward", "probe", cli_case("""
        def probe(prompts, completions, **kw):
            return [None] * len(completions)
        """), evidence=("objective/missing_scores/probe",), note="documented: None is 'no score'"),
    Case("reward_returns_strings", "reward", "probe", cli_case("""
        def probe(prompts, completions, **kw):
            return ["1.0"] * len(completions)
        """)),
    Case("reward_returns_generator", "reward", "probe", cli_case("""
        def probe(prompts, completions, **kw):
            return (1.0 for _ in completions)
        """)),
    Case("reward_sys_exit", "reward", "probe", cli_case("""
        import sys
        def probe(prompts, completions, **kw):
            sys.exit(3)
        """), bug=True),
    Case("reward_keyboard_interrupt", "reward", "probe", cli_case("""
        def probe(prompts, completions, **kw):
            raise KeyboardInterrupt
        """), bug=True),
    Case("reward_async_never_awaits", "reward", "probe", cli_case("""
        import time
        async def probe(prompts, completions, **kw):
            time.sleep(3600)
        """), bound=(RETRIES + 1) * (DEADLINE + LOOP_GRACE) + BACKOFF),
    Case("reward_async_hangs", "reward", "probe", cli_case("""
        import asyncio
        async def probe(prompts, completions, **kw):
            await asyncio.Event().wait()
        """), bound=CALL_BOUND),
    Case("reward_huge_score", "reward", "probe", cli_case("""
        def probe(prompts, completions, **kw):
            return [1e12] * len(completions)
        """)),
    Case("reward_prints_to_stdout", "reward", "probe", cli_case("""
        def probe(prompts, completions, **kw):
            print("DEBUG scoring", len(completions))
            return [1.0] * len(completions)
        """), evidence=("DEBUG scoring",), note="not a misbehaviour: the print must pass through"),
]


# --------------------------------------------------------------------------------------------- files and signals
BASE_RUN: Path | None = None  # a finished tiny run with a checkpoint per update, made once, copied by cases
LAST = "checkpoint-2"  # its newest checkpoint (the last update is saved as the model, not as a checkpoint)


def base_run(workdir: Path) -> Path:
    global BASE_RUN
    if BASE_RUN is None:
        BASE_RUN = workdir / "base_run"
        if not (BASE_RUN / LAST).is_dir():
            shutil.rmtree(BASE_RUN, ignore_errors=True)
            subprocess.run([*TRL_PPO, "train", *TINY, "--save_strategy", "steps", "--save_steps", "1",
                            "--output_dir", str(BASE_RUN)], check=True, capture_output=True)  # fmt: skip
    return BASE_RUN


def copied_run(folder: Path, workdir: Path, without_model: bool = False) -> Path:
    output = folder / "out"
    shutil.copytree(base_run(workdir), output)
    if without_model:  # a run killed after its last checkpoint, before its final save
        for name in ("model.safetensors", "config.json", "trainer_state.json"):
            (output / name).unlink(missing_ok=True)
    (output / NOTES).write_text("mine\n")
    return output


def resume_case(damage: Callable[[Path], None], *extra: str, resume: str = "latest", without_model=True):
    def setup(folder: Path) -> dict:
        output = copied_run(folder, folder.parent, without_model)
        damage(output)
        command = [*TRL_PPO, "train", *TINY, "--save_strategy", "steps",
                   "--save_steps", "1", "--output_dir", str(output), "--resume_from_checkpoint", resume, *extra]
        return {"command": command, "output_dir": output, "after_damage": True}

    return setup


def truncate(name: str):
    def damage(output: Path) -> None:
        path = output / LAST / name
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    return damage


def remove(name: str):
    def damage(output: Path) -> None:
        (output / LAST / name).unlink()

    return damage


def remove_from(folder: Path, name: str) -> None:
    (folder / name).unlink()


def output_is_file(folder: Path) -> dict:
    output = folder / "out"
    output.write_text("a file of mine\n")
    return {"command": [*TRL_PPO, "train", *TINY, "--output_dir", str(output)], "output_dir": output,
            "file_output": True}


def output_under_file(folder: Path) -> dict:
    (folder / "afile").write_text("x")
    output = folder / "afile" / "out"
    return {"command": [*TRL_PPO, "train", *TINY, "--output_dir", str(output)], "output_dir": output}


def other_run_checkpoint(folder: Path) -> dict:
    output = folder / "out"
    output.mkdir()
    (output / NOTES).write_text("mine\n")
    other = copied_run(folder / "other", folder.parent)
    command = [*TRL_PPO, "train", *TINY, "--seed", "7", "--output_dir", str(output), "--resume_from_checkpoint",
               str(other / LAST)]
    return {"command": command, "output_dir": output, "also": other}


def overwrite_finished(folder: Path) -> dict:
    output = copied_run(folder, folder.parent)
    command = [*TRL_PPO, "train", *TINY, "--output_dir", str(output), "--overwrite_output_dir"]
    return {"command": command, "output_dir": output, "overwrite": True}


def signalled(signum: int, when: str, second: float | None):
    """A fresh run sent `signum` once `when` appears in its output ("checkpoint-1": once that checkpoint exists),
    and again `second` seconds later."""

    def setup(folder: Path) -> dict:
        output = folder / "out"
        output.mkdir()
        (output / NOTES).write_text("mine\n")
        command = [*TRL_PPO, "train", *TINY, "--total_episodes", "48", "--save_strategy", "steps", "--save_steps",
                   "1", "--output_dir", str(output)]  # fmt: skip
        if when == "table":
            command += ["--num_sample_generations", "1", "--per_device_eval_batch_size", "8"]
        return {"command": command, "output_dir": output, "signal": (signum, when, second)}

    return setup


FILES = [
    Case("output_dir_is_a_file", "files", "out", output_is_file),
    Case("output_dir_under_a_file", "files", "afile", output_under_file),
    Case("resume_truncated_trainer_state", "files", LAST, resume_case(truncate("trainer_state.json")),
         evidence=(LAST,), note="latest: skips it, resumes checkpoint-1"),
    Case("resume_missing_optimizer", "files", LAST, resume_case(remove("optimizer.pt")), evidence=(LAST,)),
    Case("resume_missing_manifest", "files", LAST, resume_case(remove("manifest.json")), evidence=(LAST,)),
    Case("resume_given_damaged_path", "files", LAST, resume_case(truncate("model.safetensors"), resume="LAST")),
    Case("resume_auto_every_checkpoint_damaged", "files", "checkpoint-1",
         resume_case(lambda output: [remove_from(output / name, "manifest.json") for name in ("checkpoint-1", LAST)],
                     resume="auto"), note="auto never starts over a folder of damaged checkpoints"),
    Case("resume_leftover_tmp_checkpoint", "files", "tmp-checkpoint",
         resume_case(lambda output: shutil.copytree(output / LAST, output / "tmp-checkpoint-3-20260101000000-1")),
         evidence=("tmp-checkpoint",), note="a killed save's staging folder"),
    Case("resume_other_config", "files", "seed", resume_case(lambda output: None, "--seed", "9")),
    Case("resume_other_runs_checkpoint", "files", "seed", other_run_checkpoint),
    Case("overwrite_keeps_my_files", "files", NOTES, overwrite_finished, note="--overwrite_output_dir"),
    Case("sigterm_twice", "signals", "SIGTERM", signalled(signal.SIGTERM, "checkpoint-1", 0.3),
         evidence=("--resume_from_checkpoint latest",)),
    Case("sigint_twice", "signals", "SIGINT", signalled(signal.SIGINT, "checkpoint-1", 0.3),
         note="documented: a second Ctrl-C interrupts at once"),
    Case("sigint_in_final_table", "signals", "SIGINT", signalled(signal.SIGINT, "Saved the trained policy", None)),
    Case("sigterm_in_final_table", "signals", "SIGTERM",
         signalled(signal.SIGTERM, "Saved the trained policy", None)),
]

"""Probe what else can hang a run or lose what a user made (issue 46, part 5).

Each case is a misbehaving input (a reward function, an environment, a tool, a damaged or odd output folder, a
signal at an awkward moment), run as its own subprocess with a wall-clock limit: the case's documented deadlines
(set small: `reward_timeout`, `tool_timeout`, `environment_timeout` of 2 s, `user_call_retries=1`, backoff 0.5 s),
times the tries, plus a margin for the run itself. Each ends with one outcome:

- `handled`: the run finished (status 0) and the misbehaviour shows in a metric or a warning;
- `finished, unseen`: the run finished but nothing shows the misbehaviour;
- `stopped, named`: the run stopped with a message naming the culprit as its last line, every checkpoint that
  verified before still verifies; no traceback, except one into the user's own code when the culprit is a bug in
  it (there the traceback is what the user needs). Through the Python API (the agent cases), the exception's one
  line (`Type: message`) is the message;
- `stopped, traceback`: stopped with a raw traceback not needed to fix anything, or a last line that does not name
  the culprit;
- `hung`: still running at the limit (killed);
- `lost`: something the user had was lost or damaged: a checkpoint that verified before, a file of theirs in the
  output folder (`my_notes.txt`), or the final model of a run that said it finished.

CLI cases run `trl-ppo train` on the embedded default job (tiny, CPU); agent cases (environments, tools) train a
tiny Qwen2-shaped policy on the tool tokenizer through the Python API, with the model's turns scripted (each
episode calls the case's tool once, then answers) so that the user code under test is reached in every episode.

    OMP_NUM_THREADS=1 .venv/bin/python benchmark/reliability/probe.py                # every case, a table
    OMP_NUM_THREADS=1 .venv/bin/python benchmark/reliability/probe.py --cases reward_nan,tool_raises
    OMP_NUM_THREADS=1 .venv/bin/python benchmark/reliability/probe.py --list

One case at a time (the machine may be shared). Exit status 0 unless a case ends `hung` or `lost`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
TRL_PPO = [PYTHON, "-m", "trl_ppo"]
OUTCOMES = ("handled", "finished, unseen", "stopped, named", "stopped, traceback", "hung", "lost")
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


# ----------------------------------------------------------------------------------------- environments and tools
AGENT_CODE = r'''
import asyncio, math, os, sys, threading, time

FOREVER = threading.Event()


def ok_tool(a: int) -> str:
    """Echo a number.

    Args:
        a: the number.
    """
    return str(a)


class Base:
    def reset(self, **row):
        return "Call the tool once."

    def get_reward(self):
        return 1.0


def tool_hangs(a: int) -> str:
    """Hang.

    Args:
        a: the number.
    """
    FOREVER.wait()


def tool_sleeps_past(a: int) -> str:
    """Sleep past the deadline.

    Args:
        a: the number.
    """
    time.sleep(4)
    return "late"


def tool_raises(a: int) -> str:
    """Raise.

    Args:
        a: the number.
    """
    raise RuntimeError("tool bug")


def tool_huge(a: int) -> str:
    """A huge answer.

    Args:
        a: the number.
    """
    return "x" * 20_000_000


def tool_object(a: int):
    """A non-string answer.

    Args:
        a: the number.
    """
    return object()


def tool_none(a: int):
    """Returns None.

    Args:
        a: the number.
    """
    return None


def tool_prints(a: int) -> str:
    """Print to stdout.

    Args:
        a: the number.
    """
    print("TOOL PRINTED", a)
    return str(a)


async def tool_async_blocks(a: int) -> str:
    """Block the event loop.

    Args:
        a: the number.
    """
    time.sleep(9)
    return "late"


def tool_exits(a: int) -> str:
    """Call sys.exit.

    Args:
        a: the number.
    """
    sys.exit(4)


def tool_keyboard_interrupt(a: int) -> str:
    """Raise KeyboardInterrupt.

    Args:
        a: the number.
    """
    raise KeyboardInterrupt


class env_init_raises(Base):
    def __init__(self):
        raise ValueError("env bug in __init__")


class env_init_hangs(Base):
    def __init__(self):
        FOREVER.wait()


class env_init_connection_error(Base):
    def __init__(self):
        raise ConnectionError("sandbox unreachable")


class env_reset_hangs(Base):
    def reset(self, **row):
        FOREVER.wait()


class env_reset_returns_int(Base):
    def reset(self, **row):
        return 42


class env_get_reward_hangs(Base):
    def get_reward(self):
        FOREVER.wait()


class env_get_reward_nan(Base):
    def get_reward(self):
        return math.nan


class env_get_reward_none(Base):
    def get_reward(self):
        return None


class env_close_hangs(Base):
    def close(self):
        FOREVER.wait()


class env_close_raises(Base):
    def close(self):
        raise OSError("close failed")


class env_async_reset_blocks(Base):
    async def reset(self, **row):
        time.sleep(3600)


class env_get_reward_exits(Base):
    def get_reward(self):
        os._exit(5)
'''


def run_agent(case: str, output_dir: str) -> None:
    """The agent driver (in the case's subprocess): a tiny tool run, 2 updates of 2 episodes, with the case's tool
    (`tool_*`) or environment (`env_*`); an exception ends the process with its one line, status 1."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Qwen2Config

    from trl_ppo import PPOConfig, PPOTrainer
    from trl_ppo.agents import runner
    from trl_ppo.agents.tiny_chat import build_tool_tokenizer

    namespace: dict = {"__name__": "probe_agent"}
    exec(compile(AGENT_CODE, "probe_agent.py", "exec"), namespace)
    tokenizer = build_tool_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=2048,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config)
    tool = namespace[case] if case.startswith("tool_") else namespace["ok_tool"]
    environment = namespace[case] if case.startswith("env_") else namespace["Base"]
    name = tool.__name__
    call = f'<tool_call>{{"name": "{name}", "arguments": {{"a": 7}}}}</tool_call><|im_end|>'

    def scripted(models, sampling):  # each episode: one call of the tool, then an answer
        def sample_turn(contexts, max_new_tokens):
            turns = []
            for context in contexts:
                answered = "</tool_response>" in tokenizer.decode(context)
                text = "Done.<|im_end|>" if answered else call
                turns.append(tokenizer.encode(text, add_special_tokens=False)[:max_new_tokens])
            return turns

        return sample_turn

    runner.turn_sampler = scripted
    args = PPOConfig(output_dir=output_dir, max_turns=2, response_length=200, total_episodes=4, stop_token="eos",
                     num_ppo_epochs=1, per_device_train_batch_size=2, gradient_accumulation_steps=1,
                     local_rollout_forward_batch_size=2, learning_rate=1e-3, num_sample_generations=0,
                     logging_steps=1, save_strategy="steps", save_steps=1, report_to="none", seed=3,
                     max_tool_response_length=64, tool_timeout=DEADLINE, environment_timeout=DEADLINE,
                     reward_timeout=DEADLINE, user_call_retries=RETRIES, user_call_backoff=BACKOFF)  # fmt: skip
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Echo {i}."}] for i in range(4)]})
    try:
        trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=None, reward_model=[],
                             train_dataset=dataset, value_model=None, tools=[tool],
                             environment_factory=environment)  # fmt: skip
        trainer.train()
        trainer.save_model(output_dir)
    except Exception as error:  # the Python API's message: the exception's one line, after its traceback
        sys.stdout.flush()
        traceback.print_exc()
        print(f"{type(error).__name__}: {error}".replace("\n", " "), file=sys.stderr)
        sys.exit(1)
    print(f"Saved the trained policy to {output_dir}")


def agent_case(name: str):
    def setup(folder: Path) -> dict:
        output = folder / "out"
        output.mkdir()
        (output / NOTES).write_text("mine\n")
        return {"command": [PYTHON, __file__, "--agent", name, str(output)], "output_dir": output, "api": True}

    return setup


ENV_BOUND = CALL_BOUND * 2  # a probe environment made at construction, then the episodes'
AGENTS = [
    Case("tool_hangs", "tool", "tool_hangs", agent_case("tool_hangs"), bound=4 * DEADLINE,
         evidence=("env/tool_timeouts",)),
    Case("tool_sleeps_past_deadline", "tool", "tool_sleeps_past", agent_case("tool_sleeps_past"),
         bound=4 * DEADLINE, evidence=("env/tool_timeouts",)),
    Case("tool_raises", "tool", "tool_raises", agent_case("tool_raises"), evidence=("env/tool_errors",)),
    Case("tool_huge_answer", "tool", "tool_huge", agent_case("tool_huge"), evidence=("env/truncated_tool_responses",),
         note="20 MB answer, max_tool_response_length=64"),
    Case("tool_returns_object", "tool", "tool_object", agent_case("tool_object"), evidence=()),
    Case("tool_returns_none", "tool", "tool_none", agent_case("tool_none"), evidence=()),
    Case("tool_prints", "tool", "tool_prints", agent_case("tool_prints"), evidence=("TOOL PRINTED",),
         note="not a misbehaviour: the print must pass through"),
    Case("tool_async_blocks_loop", "tool", "tool_async_blocks", agent_case("tool_async_blocks"),
         bound=4 * (DEADLINE + LOOP_GRACE + 9), evidence=("env/tool_timeouts",)),
    Case("tool_sys_exit", "tool", "tool_exits", agent_case("tool_exits"), evidence=("env/tool_errors",)),
    Case("tool_keyboard_interrupt", "tool", "tool_keyboard_interrupt", agent_case("tool_keyboard_interrupt"),
         evidence=("env/tool_errors",)),
    Case("env_init_raises", "environment", "env_init_raises", agent_case("env_init_raises"), bug=True),
    Case("env_init_hangs", "environment", "env_init_hangs", agent_case("env_init_hangs"), bound=ENV_BOUND),
    Case("env_init_connection_error", "environment", "env_init_connection_error",
         agent_case("env_init_connection_error"), bound=ENV_BOUND),
    Case("env_reset_hangs", "environment", "env_reset_hangs", agent_case("env_reset_hangs"), bound=ENV_BOUND),
    Case("env_reset_returns_int", "environment", "env_reset_returns_int", agent_case("env_reset_returns_int")),
    Case("env_async_reset_blocks_loop", "environment", "env_async_reset_blocks",
         agent_case("env_async_reset_blocks"), bound=2 * (RETRIES + 1) * (DEADLINE + LOOP_GRACE) + BACKOFF),
    Case("env_get_reward_hangs", "environment", "env_get_reward_hangs", agent_case("env_get_reward_hangs"),
         bound=CALL_BOUND),
    Case("env_get_reward_nan", "environment", "env_get_reward_nan", agent_case("env_get_reward_nan")),
    Case("env_get_reward_none", "environment", "env_get_reward_none", agent_case("env_get_reward_none")),
    Case("env_close_hangs", "environment", "env_close_hangs", agent_case("env_close_hangs"), bound=3 * DEADLINE,
         evidence=("calls/timeouts", "env_close_hangs.close()")),
    Case("env_close_raises", "environment", "env_close_raises", agent_case("env_close_raises"),
         evidence=("env_close_raises.close()",)),
    Case("env_get_reward_os_exit", "environment", "env_get_reward_exits", agent_case("env_get_reward_exits"),
         note="os._exit cannot be caught by anyone: what is left on disk is what counts"),
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

CASES = REWARDS + AGENTS + FILES


# ---------------------------------------------------------------------------------------------------- the checks
def verified_checkpoints(output: Path) -> dict[str, str]:
    """{sha256 of manifest.json: folder name} of every folder under `output` that verifies."""
    from trl_ppo.checkpoint.manifest import checkpoint_problem

    found = {}
    if output.is_dir():
        for folder in output.iterdir():
            manifest = folder / "manifest.json"
            if manifest.is_file() and checkpoint_problem(str(folder)) is None:
                found[hashlib.sha256(manifest.read_bytes()).hexdigest()] = folder.name
    return found


def logged_metrics(output: Path) -> dict[str, float]:
    """Each metric's largest value over the run's log history (trainer_state.json, or the newest checkpoint's)."""
    states = [output / "trainer_state.json", *sorted(output.glob("checkpoint-*/trainer_state.json"))]
    values: dict[str, float] = {}
    for path in states:
        try:
            history = json.loads(path.read_text())["log_history"]
        except (OSError, ValueError, KeyError):
            continue
        for entry in history:
            for key, value in entry.items():
                if isinstance(value, (int, float)):
                    values[key] = max(values.get(key, value), value)
    return values


PROGRESS = re.compile(r"\d+%\|.*\|.*\]$")  # a tqdm bar
TABLE_RULE = set("─│┌┐└┘├┤┬┴┼═╭╮╰╯ ")


def last_line(text: str) -> str:
    """The last line of `text` that says something: not a progress bar, nor a table's border."""
    lines = [line.strip() for line in re.split(r"[\r\n]+", text)]
    lines = [line for line in lines if line and not PROGRESS.search(line) and not set(line) <= TABLE_RULE]
    return lines[-1] if lines else ""


def run_case(case: Case, workdir: Path) -> Result:
    folder = workdir / case.name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    spec = case.setup(folder)
    output: Path = spec["output_dir"]
    command = [str(folder / "out" / LAST) if part == "LAST" else part for part in spec["command"]]
    before = verified_checkpoints(output)
    if "also" in spec:
        before_other = verified_checkpoints(spec["also"])
    limit = START + case.bound
    log = folder / "output.txt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    start = time.monotonic()
    with open(log, "wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, cwd=folder, env=env,
                                   start_new_session=True)  # fmt: skip
        hung = False
        sent = False
        while process.poll() is None:
            if time.monotonic() - start > limit:
                hung = True
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                break
            if "signal" in spec and not sent:
                signum, when, second = spec["signal"]
                seen = (output / when).is_dir() if when.startswith("checkpoint") else when in log.read_text("utf-8", "replace")
                if seen:
                    process.send_signal(signum)
                    if second is not None:
                        time.sleep(second)
                        if process.poll() is None:
                            process.send_signal(signum)
                    sent = True
            time.sleep(0.05)
    seconds = time.monotonic() - start
    text = log.read_text("utf-8", "replace")
    line = last_line(text)
    if hung:
        return Result(case, "hung", seconds, line, f"killed at the limit, {limit:.0f} s")
    # lost: a checkpoint that verified before, the user's file, or the model of a run that said it was saved
    after = verified_checkpoints(output)
    lost = [name for digest, name in before.items() if digest not in after]
    if spec.get("overwrite"):  # --overwrite_output_dir deletes the checkpoints, as documented: only the rest counts
        lost = []
    if "also" in spec:
        after_other = verified_checkpoints(spec["also"])
        lost += [f"other/{name}" for digest, name in before_other.items() if digest not in after_other]
    if spec.get("file_output"):
        if not output.is_file() or output.read_text() != "a file of mine\n":
            lost.append("the file given as --output_dir")
    elif output.is_dir() and not (output / NOTES).is_file():
        lost.append(NOTES)
    if "Saved the trained policy" in text and not (output / "model.safetensors").is_file():
        lost.append("the final model")
    if lost:
        return Result(case, "lost", seconds, line, "lost: " + ", ".join(lost))
    rc = process.returncode
    # Through the Python API a traceback is how every exception shows: its last line is the message.
    has_traceback = "Traceback (most recent call last)" in text and not spec.get("api")
    if rc == 0:
        metrics = logged_metrics(output)
        seen = [item for item in case.evidence if metrics.get(item, 0) > 0 or (item not in metrics and item in text)]
        if "signal" in spec:  # a signal: rc 0 with the checkpoints intact is the documented ending
            return Result(case, "handled", seconds, line, f"rc 0; checkpoints {sorted(after.values())}")
        if seen or not case.evidence and "Warning" in text and case.culprit in text:
            return Result(case, "handled", seconds, line, "seen: " + ", ".join(seen or [case.culprit]))
        return Result(case, "finished, unseen", seconds, line, f"rc 0; none of {list(case.evidence)} seen")
    named = case.culprit in line
    if "signal" in spec and f"Stopped by {case.culprit}" in text:  # the message, then the resume command
        named = True
    if case.bug and re.search(r'File "[^"]*(probe_agent|reward)\.py"', text):
        named = True  # a bug: the traceback shows the line of the user's code that raised
    if named and (not has_traceback or case.bug):
        return Result(case, "stopped, named", seconds, line, f"rc {rc}" + (", traceback into user code" if has_traceback else ""))
    why = "a traceback" if has_traceback else "the last line does not name it"
    return Result(case, "stopped, traceback", seconds, line, f"rc {rc}; {why}")


def table(results: list[Result]) -> str:
    rows = ["| case | kind | outcome | seconds | last line of output |", "|---|---|---|---|---|"]
    for result in results:
        text = result.last_line.replace("|", "\\|")
        text = text if len(text) <= 160 else text[:157] + "..."
        rows.append(f"| {result.case.name} | {result.case.kind} | {result.outcome} | {result.seconds:.1f} | `{text}` |")
    counts = Counter(result.outcome for result in results)
    rows += ["", "| outcome | cases |", "|---|---|"]
    rows += [f"| {outcome} | {counts[outcome]} |" for outcome in OUTCOMES]
    rows.append(f"| total | {len(results)} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--workdir", help="where cases run (default: a new temporary folder, removed at the end)")
    parser.add_argument("--json", help="also write the results to this JSON-lines file")
    parser.add_argument("--agent", nargs=2, metavar=("CASE", "OUTPUT_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.agent:
        run_agent(*args.agent)
        return 0
    if args.list:
        for case in CASES:
            print(f"{case.name:32} {case.kind:12} {case.note}")
        return 0
    chosen = CASES
    if args.cases:
        names = args.cases.split(",")
        unknown = sorted(set(names) - {case.name for case in CASES})
        if unknown:
            parser.error(f"unknown case(s): {', '.join(unknown)}")
        chosen = [case for case in CASES if case.name in names]
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="trl_ppo_probe_"))
    workdir.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for case in chosen:
            result = run_case(case, workdir)
            results.append(result)
            print(f"{case.name}: {result.outcome} ({result.seconds:.1f} s; {result.detail})", file=sys.stderr)
            if args.json:
                with open(args.json, "a") as sink:
                    sink.write(json.dumps({"case": case.name, "kind": case.kind, "outcome": result.outcome,
                                           "seconds": round(result.seconds, 1), "last_line": result.last_line,
                                           "detail": result.detail}) + "\n")  # fmt: skip
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print(table(results))
    return 1 if any(result.outcome in ("hung", "lost") for result in results) else 0


if __name__ == "__main__":
    sys.exit(main())

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

User code that is no misbehaviour (`probe_usercode.py`, `probe_usercode_agents.py`: an HTTP judge, `subprocess`,
`multiprocessing`, math_verify, `SIGALRM`, ...) runs under the DEFAULT deadlines, and a run of it that finishes ends
`worked` (every piece of evidence that the code did its work is seen) or `finished, not worked`; one that does not
finish is classified as above.

CLI cases run `trl-ppo train` on the embedded default job (tiny, CPU); agent cases (environments, tools) train a
tiny Qwen2-shaped policy on the tool tokenizer through the Python API, with the model's turns scripted (each
episode calls the case's tool once, then answers) so that the user code under test is reached in every episode.

    OMP_NUM_THREADS=1 .venv/bin/python benchmark/reliability/probe.py                # every case, a table
    OMP_NUM_THREADS=1 .venv/bin/python benchmark/reliability/probe.py --cases reward_nan,tool_raises
    OMP_NUM_THREADS=1 .venv/bin/python benchmark/reliability/probe.py --list

One case at a time (the machine may be shared). Exit status 0 unless a case ends `hung` or `lost`.

This file is the runner (the checks, `run_case`, `table`, `main`); the cases are beside it: `probe_cases.py` (the
shared constants, `Case`, `Result`, the reward and the files and signals cases), `probe_agents.py` (the
environment and tool cases, their `AGENT_CODE` and `run_agent`, which the case's subprocess reaches through this
file's hidden `--agent`) and the user code cases (`probe_usercode.py`, `probe_usercode_agents.py`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the case modules beside it
from probe_agents import AGENTS, run_agent  # noqa: E402
from probe_cases import FILES, LAST, NOTES, OUTCOMES, REWARDS, START, WORK_OUTCOMES, Case, Result  # noqa: E402
from probe_usercode import USER_REWARDS  # noqa: E402
from probe_usercode_agents import USER_AGENT_CODE, USER_AGENT_NAMES, USER_AGENTS  # noqa: E402

CASES = REWARDS + AGENTS + FILES + USER_REWARDS + USER_AGENTS


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
        if case.works:
            return work_result(case, seconds, line, metrics, text)
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


def work_result(case: Case, seconds: float, line: str, metrics: dict, text: str) -> Result:
    """A finished run of user code that is no misbehaviour: `worked` when every evidence shows (a metric logged, at
    any value, or a text in the output) and no call said `PROBE FAILED`."""
    missing = [item for item in case.evidence if item not in metrics and item not in text]
    failed = [found.strip() for found in re.findall(r"PROBE FAILED[^\n]*", text)[:1]]
    answers = [found.strip() for found in re.findall(r"TOOL ANSWER: [^\n]*", text)[:1]]
    if not missing and not failed:
        return Result(case, "worked", seconds, line, "seen: " + ", ".join(case.evidence))
    detail = [*failed, *answers] + ([f"not seen: {missing}"] if missing else [])
    return Result(case, "finished, not worked", seconds, line, "; ".join(detail))


def table(results: list[Result]) -> str:
    rows = ["| case | kind | outcome | seconds | last line of output |", "|---|---|---|---|---|"]
    for result in results:
        text = result.last_line.replace("|", "\\|")
        text = text if len(text) <= 160 else text[:157] + "..."
        rows.append(f"| {result.case.name} | {result.case.kind} | {result.outcome} | {result.seconds:.1f} | `{text}` |")
    counts = Counter(result.outcome for result in results)
    rows += ["", "| outcome | cases |", "|---|---|"]
    shown = [outcome for outcome in WORK_OUTCOMES if counts[outcome]] + list(OUTCOMES)  # the first two when any
    rows += [f"| {outcome} | {counts[outcome]} |" for outcome in shown]
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
        case, output_dir = args.agent
        run_agent(case, output_dir, USER_AGENT_CODE if case in USER_AGENT_NAMES else None)
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

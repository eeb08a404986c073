"""Kill a run at random moments, resume it, and check that nothing was lost (issue 46, part 2).

    python benchmark/reliability/kill_resume.py --trials 40 [--updates 16] [--kills 3] [--seed 0] \
        [--out kill_resume.jsonl]

The run is `trl-ppo`'s embedded job, tiny and on the CPU: `--updates` updates of 8 episodes, a checkpoint after
every update and `--save_total_limit 2` (so kills land in saves and rotations too), always started with the same
command, the one a cluster requeues: `--resume_from_checkpoint auto`. A reference run goes uninterrupted. Each
trial then starts the run in a fresh folder, SIGKILLs it at a random moment (two times in three drawn over the
reference run's updates, else over its whole duration), up to `--kills` times (each time the command again), and
at last lets it finish. After every kill the checkpoints left must all verify against their manifests, and the
newest must not be older than before the kill. A trial's outcome:

* `identical`: the final model is bit-identical to the reference run's;
* `different`: it is not (a silent continuation from a wrong state: a bug);
* `refused`: a start refused the folder, with the message (e.g. a damaged checkpoint named);
* `failed` / `hung`: the last start exited with an error, or did not end within `--timeout` seconds.

Runs go one at a time, with one CPU thread (`OMP_NUM_THREADS=1`), each in a process forked from a server that has
imported trl_ppo once (multiprocessing's forkserver), so a start costs the run, not the imports. The quick test
(`tests/test_kill_resume.py`) runs a few trials; the table of a long run is in docs/resuming.md.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmark/: rows.py
from rows import append_row  # noqa: E402

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported, here and in the fork server
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def job_flags(updates: int) -> list[str]:
    """`updates` updates of 8 episodes, a checkpoint after each, the two newest kept; the requeued command."""
    return [
        *("--total_episodes", str(8 * updates), "--per_device_train_batch_size", "8"),
        *("--gradient_accumulation_steps", "1", "--num_ppo_epochs", "1", "--response_length", "4"),
        *("--num_sample_generations", "0", "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "1"),
        *("--save_total_limit", "2", "--disable_tqdm", "True", "--report_to", "none"),
        *("--resume_from_checkpoint", "auto"),
    ]


def train(output_dir: str, log: str, updates: int) -> None:
    """One start of the run (in a child process), its output appended to `log`."""
    handle = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(handle, 1)
    os.dup2(handle, 2)
    import tqdm

    tqdm.tqdm.set_lock(threading.RLock())  # not tqdm's multiprocessing lock, which a killed process would leak
    from trl_ppo.cli import main

    main(["train", "--output_dir", output_dir, *job_flags(updates)])


class Runner:
    """Starts of the run, one at a time, forked from a server that imported trl_ppo."""

    def __init__(self, updates: int, timeout: float = 120.0) -> None:
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(["trl_ppo.cli", "trl_ppo.trainer"])
        self.updates, self.timeout = updates, timeout
        warm_up = self.context.Process(target=os.getpid)  # starts the server: its imports are not a run's time
        warm_up.start()
        warm_up.join()

    def start(self, output_dir: str):
        process = self.context.Process(target=train, args=(output_dir, output_dir + ".log", self.updates))
        process.start()
        return process

    def run(self, output_dir: str, kill_after: float | None = None) -> tuple[str, float]:
        """Start the run in `output_dir`; SIGKILL it after `kill_after` seconds if it still runs -> ("killed",
        "exited <code>" or "hung", seconds)."""
        started = time.monotonic()
        process = self.start(output_dir)
        process.join(self.timeout if kill_after is None else kill_after)
        if process.is_alive():
            process.kill()
            process.join()
            return ("killed" if kill_after is not None else "hung"), time.monotonic() - started
        return f"exited {process.exitcode}", time.monotonic() - started

    def reference(self, output_dir: str) -> tuple[float, tuple[float, float]]:
        """The uninterrupted run in `output_dir` -> (its seconds, (seconds to its first checkpoint, to its last)),
        the folder watched every 10 ms."""
        from trl_ppo.checkpoint.folders import checkpoint_step

        started, process, seen = time.monotonic(), self.start(output_dir), {}
        while process.is_alive() and time.monotonic() - started < self.timeout:
            names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
            for step in filter(None, map(checkpoint_step, names)):
                seen.setdefault(step, time.monotonic() - started)
            process.join(0.01)
        if process.is_alive() or process.exitcode != 0 or self.updates not in seen:
            process.kill()
            raise RuntimeError(f"The reference run failed: {last_line(output_dir + '.log')}")
        return time.monotonic() - started, (min(seen.values()), seen[self.updates])


def final_weights(output_dir: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(output_dir, "model.safetensors"))


def same_weights(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


def checkpoints_left(output_dir: str) -> tuple[list[int], list[str]]:
    """(the updates of the checkpoints in `output_dir`, the problems of those that do not verify)."""
    from trl_ppo.checkpoint.folders import checkpoint_folders, checkpoint_step
    from trl_ppo.checkpoint.manifest import checkpoint_problem

    steps, problems = [], []
    for path in checkpoint_folders(output_dir):
        steps.append(checkpoint_step(path))
        problem = checkpoint_problem(path)
        if problem is not None:
            problems.append(f"{os.path.basename(path)}: {problem}")
    return steps, problems


def last_line(log: str) -> str:
    with open(log, encoding="utf-8", errors="replace") as handle:
        lines = [line.strip() for line in handle if line.strip()]
    return lines[-1] if lines else ""


def landing(ended: str, steps: list[int], updates: int) -> str:
    """Where a kill landed, from the checkpoints it left in a run of `updates` updates."""
    if ended != "killed":
        return "after the run had ended"
    if not steps:
        return "before the first checkpoint"
    return "after the last checkpoint, in the final save" if max(steps) == updates else "between checkpoints"


def trial(runner: Runner, folder: str, reference: dict, timing: tuple, kills: int, rng: random.Random) -> dict:
    """Kill the run up to `kills` times at random moments, then let it finish -> the trial's record. `timing`:
    (the reference run's seconds, (to its first checkpoint, to its last)); two kills in three are drawn over the
    updates (from a little before the first checkpoint to the last), so that many land in saves and rotations,
    the others over the whole run."""
    record = {"kills": [], "problems": []}
    newest, (duration, (first, last)) = 0, timing
    for _ in range(kills):
        moment = rng.uniform(0.8 * first, last) if rng.random() < 2 / 3 else rng.uniform(0.0, duration)
        ended, _ = runner.run(folder, kill_after=moment)
        steps, problems = checkpoints_left(folder)
        landed = landing(ended, steps, runner.updates)
        record["kills"].append({"at": round(moment, 2), "ended": ended, "landed": landed, "checkpoints": steps})
        record["problems"] += problems
        if steps and max(steps) < newest:
            record["problems"].append(f"the newest checkpoint went back from {newest} to {max(steps)}")
        newest = max(steps, default=newest)
        if ended != "killed":
            break
    ended, seconds = runner.run(folder)
    if ended == "hung":
        record["outcome"] = "hung"
    elif ended != "exited 0":
        message = last_line(folder + ".log")
        record["outcome"], record["message"] = ("refused" if message.startswith("trl-ppo:") else "failed"), message
    else:
        record["outcome"] = "identical" if same_weights(final_weights(folder), reference) else "different"
    record["final_seconds"] = round(seconds, 2)
    return record


def run_trials(
    trials: int, kills: int, seed: int, workdir: str, updates: int = 6, timeout: float = 120.0, report=None
) -> dict:
    """The reference run of `updates` updates, then `trials` trials -> {"duration": s, "trials": [records]};
    `report(i, record)` is called after each."""
    runner, rng = Runner(updates, timeout), random.Random(seed)
    reference_dir = os.path.join(workdir, "reference")
    timing = runner.reference(reference_dir)
    reference, records = final_weights(reference_dir), []
    for i in range(trials):
        folder = os.path.join(workdir, f"trial-{i}")
        records.append(trial(runner, folder, reference, timing, rng.randint(1, kills), rng))
        if report is not None:
            report(i, records[-1])
        shutil.rmtree(folder, ignore_errors=True)
    return {"duration": round(timing[0], 2), "checkpoints_at": [round(t, 2) for t in timing[1]], "trials": records}


def outcome_table(records: list[dict]) -> str:
    """A Markdown table: outcomes, and where the kills landed."""
    outcomes = collections.Counter(record["outcome"] for record in records)
    landed = collections.Counter(kill["landed"] for record in records for kill in record["kills"])
    problems = sum(bool(record["problems"]) for record in records)
    rows = [f"| trials: {name} | {count} |" for name, count in sorted(outcomes.items())]
    rows.append(f"| trials where a kill left a checkpoint that did not verify, or lost a newer one | {problems} |")
    rows += [f"| kills landing {name} | {count} |" for name, count in sorted(landed.items())]
    return "| | count |\n|---|---|\n" + "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--updates", type=int, default=16, help="updates of the run, a checkpoint after each")
    parser.add_argument("--kills", type=int, default=3, help="at most this many kills per trial (drawn from 1..N)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a start may take before it is hung")
    parser.add_argument("--out", default=None, help="a JSON-lines file for each trial's record")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="kill_resume-")

    def report(i: int, record: dict) -> None:
        kills = ", ".join(f"{k['at']} s ({k['landed']})" for k in record["kills"])
        problems = f"; {record['problems']}" if record["problems"] else ""
        print(f"trial {i}: {record['outcome']}; killed at {kills}{problems}", flush=True)
        if args.out:
            append_row(args.out, record)

    started = time.monotonic()
    result = run_trials(args.trials, args.kills, args.seed, workdir, args.updates, args.timeout, report)
    first, last = result["checkpoints_at"]
    print(f"\nreference run: {result['duration']} s (checkpoints from {first} s to {last} s); {args.trials} trials "
          f"in {time.monotonic() - started:.0f} s\n")
    print(outcome_table(result["trials"]))
    shutil.rmtree(workdir, ignore_errors=True)
    sys.exit(0 if all(r["outcome"] == "identical" and not r["problems"] for r in result["trials"]) else 1)


if __name__ == "__main__":
    main()

"""Does a long run stay flat? (issue 46, part 4)

    OMP_NUM_THREADS=1 python benchmark/reliability/soak.py --updates 5000 --segment_seconds 180 --out soak.jsonl

The run is `trl-ppo`'s embedded default job (its own flags, 32 episodes an update) for `--updates` updates, a
checkpoint every `--save_steps` updates with `--save_total_limit 2`, always started with the command a cluster
requeues (`--resume_from_checkpoint auto`). `--segment_seconds` after each start, once it has saved a checkpoint,
the run gets a SIGTERM (it finishes its update, saves and exits 0) and is started again, until it ends. Whenever a checkpoint appears, the training
process is sampled: its resident memory (VmRSS) and peak (VmHWM), its open file descriptors, the disk use of the
output folder, and the checkpoint's `trainer_state.json` (bytes, `log_history` entries). One JSON line per
sample goes to `--out`; the end prints the samples nearest each thousand updates and the growth figures:

* memory within a start: the least-squares slope of RSS over updates (MiB per 1,000 updates) at each start's
  regular checkpoints from its 250th update on (RSS climbs a few MiB over a start's first ~200 updates, as the
  allocator warms up, and a preemption's save adds its own);
* open files: the least and the most seen;
* disk: the least and the most the output folder used once two checkpoints were kept;
* state: `trainer_state.json` bytes per logged entry, first checkpoint against last (a constant is linear growth,
  as one entry per `logging_steps` must be; more would be a leak).

Timings are wall seconds on whatever machine runs it, said in the summary with the CPU count.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmark/, for rows.py
from rows import append_row  # noqa: E402

EPISODES_PER_UPDATE = 32  # the default job: 16 prompts x 2 accumulation steps


def command(output_dir: str, updates: int, save_steps: int) -> list[str]:
    return [sys.executable, "-m", "trl_ppo", "train", "--output_dir", output_dir,
            "--total_episodes", str(updates * EPISODES_PER_UPDATE), "--save_strategy", "steps",
            "--save_steps", str(save_steps), "--save_total_limit", "2", "--num_sample_generations", "0",
            "--disable_tqdm", "True", "--resume_from_checkpoint", "auto"]


def proc_status(pid: int) -> dict:
    """VmRSS and VmHWM (MiB) and the open file descriptors of a live process."""
    fields = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = round(int(value.split()[0]) / 1024, 1)
    return {"rss_mib": fields["VmRSS"], "peak_rss_mib": fields["VmHWM"], "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def disk_mib(folder: str) -> float:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except FileNotFoundError:  # a rotation removed it meanwhile
                pass
    return round(total / 2**20, 2)


def state_of(checkpoint: str) -> dict:
    path = os.path.join(checkpoint, "trainer_state.json")
    with open(path) as handle:
        entries = len(json.load(handle)["log_history"])
    return {"state_bytes": os.path.getsize(path), "log_entries": entries}


def sample(pid: int, output_dir: str, step: int, start: int) -> dict | None:
    """One sample at the checkpoint of update `step` (None when the process or the checkpoint went meanwhile)."""
    try:
        return {"update": step, "start": start, **proc_status(pid), "disk_mib": disk_mib(output_dir),
                **state_of(os.path.join(output_dir, f"checkpoint-{step}"))}
    except (FileNotFoundError, ProcessLookupError, KeyError, json.JSONDecodeError):
        return None


def one_start(args, output_dir: str, start: int, log) -> tuple[list[dict], dict]:
    """Start the run, sample at each new checkpoint, SIGTERM it after `segment_seconds` -> (samples, its record)."""
    from trl_ppo.checkpoint.folders import checkpoint_folders, checkpoint_step

    process = subprocess.Popen(command(output_dir, args.updates, args.save_steps), stdout=log, stderr=log,
                               env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    began, seen, samples, signalled = time.monotonic(), set(), [], None
    if os.path.isdir(output_dir):
        seen = {checkpoint_step(path) for path in checkpoint_folders(output_dir)}
    while process.poll() is None:
        # Only while this start trains (it has saved a checkpoint, not yet the last): before its preemption handler
        # is in place, or once the process exits after the run, a SIGTERM ends it as the default action does (exit
        # -15), which would say nothing about growth.
        training = samples and max(seen) < args.updates
        if signalled is None and training and time.monotonic() - began > args.segment_seconds:
            process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
        present = checkpoint_folders(output_dir) if os.path.isdir(output_dir) else []
        steps = {checkpoint_step(path) for path in present}
        for step in sorted(steps - seen):
            row = sample(process.pid, output_dir, step, start)
            if row is not None:
                samples.append(row)
        seen |= steps
        time.sleep(0.2)
    record = {"start": start, "exit": process.returncode, "seconds": round(time.monotonic() - began, 1),
              "stop_seconds": round(time.monotonic() - signalled, 1) if signalled else None}
    # A SIGTERM sent just before the last checkpoint can land while the finished process exits: status -15, the
    # model saved (a known limit of `trl-ppo`, docs/resuming.md); the run has ended, nothing was lost.
    finished = os.path.exists(os.path.join(output_dir, "model.safetensors"))
    record["after_the_end"] = bool(signalled and finished and process.returncode == -signal.SIGTERM)
    return samples, record


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x."""
    n = len(points)
    mean_x, mean_y = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0


def summary(samples: list[dict], starts: list[dict], save_steps: int, warmup: int = 250) -> str:
    lines = ["| update | start | RSS MiB | peak RSS MiB | open fds | output_dir MiB | log entries | state bytes |",
             "|---|---|---|---|---|---|---|---|"]
    thousands = sorted({min(samples, key=lambda s, k=k: abs(s["update"] - k))["update"]
                        for k in range(0, samples[-1]["update"] + 1, 1000)})
    for row in samples:
        if row["update"] in thousands:
            lines.append(f"| {row['update']} | {row['start']} | {row['rss_mib']} | {row['peak_rss_mib']} | "
                         f"{row['fds']} | {row['disk_mib']} | {row['log_entries']} | {row['state_bytes']} |")
    slopes = []
    for start in sorted({s["start"] for s in samples}):
        mine = [s for s in samples if s["start"] == start]
        steady = [s for s in mine if s["update"] - mine[0]["update"] >= warmup and s["update"] % save_steps == 0]
        if len(steady) >= 3:
            slopes.append(round(1000 * slope([(s["update"], s["rss_mib"]) for s in steady]), 2))
    kept = [s["disk_mib"] for s in samples if s["update"] >= 2 * (samples[1]["update"] - samples[0]["update"])]
    first, last = samples[0], samples[-1]
    lines += [
        "",
        f"starts: {len(starts)} (exit codes {sorted({s['exit'] for s in starts})}, "
        f"{sum(s.get('after_the_end', False) for s in starts)} signalled as the finished run exited; SIGTERM to exit "
        f"{max((s['stop_seconds'] or 0) for s in starts)} s at most); {len(samples)} samples",
        f"RSS slope within a start after its first {warmup} updates, MiB per 1,000 updates: {slopes}",
        f"open fds: {min(s['fds'] for s in samples)} to {max(s['fds'] for s in samples)}",
        f"output_dir with two checkpoints kept: {min(kept)} to {max(kept)} MiB",
        f"trainer_state bytes per log entry: {first['state_bytes'] / max(first['log_entries'], 1):.0f} at update "
        f"{first['update']}, {last['state_bytes'] / max(last['log_entries'], 1):.0f} at update {last['update']}",
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=5000)
    parser.add_argument("--segment_seconds", type=float, default=180.0, help="a SIGTERM this long after each start")
    parser.add_argument("--save_steps", type=int, default=50)
    parser.add_argument("--max_starts", type=int, default=100, help="give up after this many starts")
    parser.add_argument("--out", help="a JSON-lines file for every sample and start")
    parser.add_argument("--work_dir", help="the run's folder's parent (default: a new temporary folder)")
    args = parser.parse_args(argv)
    work_dir = args.work_dir or tempfile.mkdtemp(prefix="soak-")
    output_dir = os.path.join(work_dir, "run")
    samples, starts = [], []
    with open(os.path.join(work_dir, "run.log"), "ab") as log:
        while len(starts) < args.max_starts and not os.path.exists(os.path.join(output_dir, "model.safetensors")):
            mine, record = one_start(args, output_dir, len(starts), log)
            samples += mine
            starts.append(record)
            print(f"start {record['start']}: exit {record['exit']} after {record['seconds']} s; updates "
                  f"{mine[0]['update'] if mine else '-'}..{mine[-1]['update'] if mine else '-'}", flush=True)
            for row in ([{"kind": "sample", **s} for s in mine] + [{"kind": "start", **record}]) if args.out else []:
                append_row(args.out, row)
            if record["exit"] != 0 and not record["after_the_end"]:
                raise SystemExit(f"start {record['start']} exited {record['exit']}: see {work_dir}/run.log")
    print(f"\n{args.updates} updates, {os.cpu_count()} CPUs, run folder {output_dir}\n")
    print(summary(samples, starts, args.save_steps))


if __name__ == "__main__":
    main()

"""Trajectories you can look at again (`trajectory_dir`): each update's episodes written as JSON lines, and their
advantages and losses recomputed from such a file without a model or sampling, so that advantage and critic code
can be debugged and tested on CPU (`trl-ppo trajectories FILE`).

One line per episode: the update, the process (`rank`), the prompt and response ids, `model_mask` (1 on the model's
own tokens, 0 on tool answers), the first token of each model turn (`turn_starts`), the per-turn rewards, the score,
the score as the rewards used it (`shaped_score`), whether the episode was cut by the budget (`truncated`; with
`truncated_episodes="bootstrap"` the recomputation adds the bootstrap term to the logged `rewards`, which are before
it) and the per-token `rewards`, `non_score_rewards` (the KL penalty), `logprobs`, `ref_logprobs`, `values`,
`advantages` and `returns` (over the response up to its last attended token; `values` and `returns` null without a
critic), the settings the advantages used; with a tokenizer, the prompt's text (`prompt`), the text of each model
turn and tool answer (`segments`) and that of each response token (`tokens`); in a run with tools or environments,
the episode's `tool_calls` and `tool_errors`. Each process appends to its own file, `trajectories-<rank>.jsonl`: the
advantages are whitened (and the groups of a critic-free estimator kept) within one process's episodes, so one file's
update recomputes alone. `trl-ppo trajectories view` shows them in a browser (`viewer.py`).

A file stays true across preemption and resume: the trainer writes an update's records once the update is applied
(an update dropped at SIGTERM writes nothing), and a file is append-only, read as one timeline. An update whose
records are written again (a run killed after writing update k but before its checkpoint redoes k on resume) is
read from its last copy, and what was written after the first copy (updates >= k of the abandoned run) is left
out: a resumed run's records replace those from its checkpoint on. The readers apply this, not the writer: a file
is only appended to, so no rewrite of it can be cut short by a kill, and a resume needs no step of its own (the
older copies stay in the file, unread). A new run written into the same folder replaces the old one the same way,
from its update 1. An update's records are one run of lines whose `episode` rises; a line of
the same update whose `episode` does not rise starts another copy. A partial last line (a write killed midway) is
left out with a warning, and cut off by the writer before it appends; a line that is not a record anywhere else is
refused, naming it.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from transformers.utils import logging

from . import estimators, losses, ppo
from .rollout import Rollout

logger = logging.get_logger(__name__)

# The settings a recomputation needs, read from the config and written on every line.
SETTINGS = ("gamma", "lam", "lam_value", "length_adaptive_lam_alpha", "gae_level", "cliprange", "cliprange_value",
            "loss_agg_mode", "truncated_episodes", "advantage_estimator", "num_generations",
            "scale_rewards")  # fmt: skip
# The start of a record's line as `write_update` writes it (`json.dumps` keeps the dict's order): a file's first
# pass reads the update and episode from it without parsing the line. Quotes inside JSON strings are escaped, so a
# whole record holds it once: a line holding it twice is a cut write with another appended to it, parsed (refused).
HEADER = re.compile(r'\{"update": (-?\d+), "rank": -?\d+, "episode": (\d+),')


def trajectory_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"trajectories-{rank}.jsonl")


def _row(values: torch.Tensor, length: int) -> list:
    return values[:length].tolist()


def episode_records(
    update: int,
    rank: int,
    rollout: Rollout,
    rewards: ppo.Rewards,
    advantages: ppo.Advantages,
    args,
    tokenizer=None,
    agent_episodes: list | None = None,
) -> list[dict]:
    """One JSON-ready dict per episode of an update (see the module's docstring). agent_episodes: the multi-turn
    episodes the rows were played from (`agents.turn_loop.Episode`, one per row), for their tool counts."""
    settings = {name: getattr(args, name, None) for name in SETTINGS}  # None: a setting the config lacks
    mask, attended = rollout.response_mask.cpu(), rollout.attended_responses.cpu()
    lengths = (attended.long().cumsum(-1).argmax(-1) + 1).masked_fill(~attended.any(-1), 0).tolist()
    starts = ppo.turn_starts(rollout.response_mask).cpu()
    per_token = {
        name: None if getattr(source, name) is None else getattr(source, name).detach().float().cpu()
        for source, names in ((rollout, ("logprobs", "ref_logprobs", "values")),
                              (rewards, ("rewards", "non_score_rewards")), (advantages, ("advantages", "returns")))
        for name in names
    }  # fmt: skip
    records = []
    for i, length in enumerate(lengths):
        query = rollout.queries[i][rollout.query_mask[i]].tolist()
        record = {"update": update, "rank": rank, "episode": i, "query_ids": query, "response_length": mask.size(1)}
        record["response_ids"] = _row(rollout.responses[i], length)
        record["model_mask"] = [int(flag) for flag in _row(mask[i], length)]
        record["turn_starts"] = starts[i].nonzero().flatten().tolist()
        record["turn_rewards"] = None if rollout.turn_rewards is None else rollout.turn_rewards[i].tolist()
        record["score"] = None if rollout.scores is None else float(rollout.scores[i])
        record["shaped_score"] = float(rewards.shaped_scores[i])
        record["truncated"] = None if rollout.truncated is None else bool(rollout.truncated[i])
        for name in ("rewards", "non_score_rewards", "logprobs", "ref_logprobs", "values", "advantages", "returns"):
            record[name] = None if per_token[name] is None else _row(per_token[name][i], length)
        if tokenizer is not None:
            record["prompt"] = tokenizer.decode(query)
            record["segments"] = segments(record["response_ids"], record["model_mask"], tokenizer)
            record["tokens"] = token_texts(record["response_ids"], tokenizer)
        if agent_episodes is not None:
            record["tool_calls"], record["tool_errors"] = agent_episodes[i].tool_calls, agent_episodes[i].tool_errors
        records.append(record | {"settings": settings})
    return records


def segments(response_ids: list[int], model_mask: list[int], tokenizer) -> list[dict]:
    """The response as its runs of model and tool tokens: [{"role": "model" | "tool", "text": ...}]."""
    runs: list[tuple[int, list[int]]] = []
    for token, flag in zip(response_ids, model_mask):
        if runs and runs[-1][0] == flag:
            runs[-1][1].append(token)
        else:
            runs.append((flag, [token]))
    return [{"role": "model" if flag else "tool", "text": tokenizer.decode(ids)} for flag, ids in runs]


def token_texts(ids: list[int], tokenizer, context: int = 4) -> list[str]:
    """The text each token adds to the decoded ids, to show them one by one: the decoding of the token with up to
    `context` tokens before it, less that of those tokens alone (a SentencePiece token decoded alone loses its
    leading space). A token that ends inside a multi-byte character shows as the replacement character."""
    texts = []
    for i in range(len(ids)):
        start = max(0, i - context)
        before, both = tokenizer.decode(ids[start:i]), tokenizer.decode(ids[start : i + 1])
        texts.append(both[len(os.path.commonprefix([before, both])) :])
    return texts


def write_update(directory: str, rank: int, records: list[dict]) -> None:
    """Append one update's records to this process's file (the folder is made when missing), after cutting off a
    partial last line left by a run killed while writing (`drop_partial_line`)."""
    os.makedirs(directory, exist_ok=True)
    path = trajectory_file(directory, rank)
    drop_partial_line(path)
    with open(path, "a", encoding="utf-8") as file:
        file.write("".join(json.dumps(record) + "\n" for record in records))


def drop_partial_line(path: str, chunk: int = 1 << 16) -> None:
    """Cut off the file's last line when a kill cut it short (no newline, not JSON), with a warning, so that the
    next record starts a line of its own; a last line that lost only its newline gets it back."""
    if not os.path.exists(path):
        return
    with open(path, "r+b") as file:
        end = file.seek(0, os.SEEK_END)
        if end == 0 or _read_at(file, end - 1, end) == b"\n":
            return
        start = end  # becomes the last line's first byte: after the last newline, read backwards a chunk at a time
        while start > 0:
            begin = max(0, start - chunk)
            block = _read_at(file, begin, start)
            if b"\n" in block:
                start = begin + block.rindex(b"\n") + 1
                break
            start = begin
        if _is_record(_read_at(file, start, end)):  # (the file is read to its end: the newline is appended)
            file.write(b"\n")
            return
        file.truncate(start)
    logger.warning(f"{path}: its last line was cut short (the run was killed while writing it); it is removed "
                   f"before this update's episodes are appended ({end - start} bytes).")  # fmt: skip


def _read_at(file, start: int, stop: int) -> bytes:
    file.seek(start)
    return file.read(stop - start)


def _is_record(text: str | bytes) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
        return False


def _parse(line: str, path: str, number: int, required: tuple[str, ...]) -> dict:
    """One line as a record: a JSON object with the `required` fields (else a ValueError naming the line)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}, line {number}: not a JSON trajectory record ({error.msg}).") from None
    missing = [name for name in required if name not in record] if isinstance(record, dict) else required
    if missing:
        raise ValueError(f"{path}, line {number}: not a trajectory record (it has no {', '.join(missing)}).")
    return record


def _update_and_episode(line: str, path: str, number: int) -> tuple[int, int | None]:
    """A line's update and episode number (None in files that have none), from its start when `write_update`
    wrote it whole, else from parsing it."""
    match = HEADER.match(line)
    if match and line.endswith("}\n") and line.count('{"update": ') == 1:
        return int(match[1]), int(match[2])
    record = _parse(line, path, number, ("update",))
    return record["update"], record.get("episode")


def kept_lines(path: str) -> list[range]:
    """The lines (numbered from 1) of one process's file that its readers show: one range per update, in update
    order, each update's last copy and nothing written before it of later updates (see the module's docstring).
    A partial last line is left out with a warning; a line that is not a record elsewhere raises ValueError."""
    kept: list[list] = []  # [update, last episode, first line, line after the last] of each copy kept so far
    with open(path, encoding="utf-8", errors="replace") as file:
        for number, line in enumerate(file, 1):
            if not line.endswith("\n") and not _is_record(line):  # only the last line can lack its newline
                logger.warning(f"{path}, line {number}: the last line is cut short (the run was killed while "
                               "writing it); it is left out and the lines before it are read.")  # fmt: skip
                break
            update, episode = _update_and_episode(line, path, number)
            last = kept[-1] if kept else None
            if last and last[0] == update and (episode is None or last[1] is None or episode > last[1]):
                last[1], last[3] = episode, number + 1  # the same write goes on
                continue
            while kept and kept[-1][0] >= update:  # written again: a resumed run redid the update from here
                kept.pop()
            kept.append([update, episode, number, number + 1])
    return [range(first, stop) for _, _, first, stop in kept]


def iter_records(path: str, required: tuple[str, ...] = ("update",), lines: list[range] | None = None):
    """The records of one process's file that its readers show (`lines`, by default `kept_lines(path)`), one at a
    time, each checked to be a JSON object with the `required` fields (an error names the line)."""
    shown = {number for numbers in (kept_lines(path) if lines is None else lines) for number in numbers}
    with open(path, encoding="utf-8", errors="replace") as file:
        for number, line in enumerate(file, 1):
            if number in shown:
                yield _parse(line, path, number, required)


def read_updates(path: str) -> dict[int, list[dict]]:
    """{update: its episodes' records, in order} from one process's file, each update once (`kept_lines`)."""
    updates = defaultdict(list)
    for record in iter_records(path):
        updates[record["update"]].append(record)
    return dict(updates)


@dataclass
class Recomputed:
    """An update recomputed from its records: `[B, T]` tensors (zero outside the model's tokens) and the losses
    at the update's start (new policy and values = the rollout's: ratio 1). Without a critic (a critic-free
    `advantage_estimator`) there are no returns and no value loss: None."""

    mask: torch.Tensor
    advantages: ppo.Advantages
    logged_advantages: torch.Tensor
    logged_returns: torch.Tensor | None
    policy_loss: torch.Tensor
    value_loss: torch.Tensor | None


def padded_rows(records: list[dict], name: str, width: int, dtype=torch.float32) -> torch.Tensor | None:
    """The records' per-token field `name` as a `[B, width]` tensor, each row right-padded with 0; None where the
    records hold none (`values` and `returns` without a critic)."""
    if records[0].get(name) is None:
        return None
    return torch.tensor([r[name] + [0] * (width - len(r[name])) for r in records], dtype=dtype)


def recompute_advantages(records: list[dict], mask: torch.Tensor) -> ppo.Advantages:
    """The advantages (and returns) of one update's records, with the estimator and settings written with them:
    GAE from the logged rewards and values, or a group estimator from the shaped scores, per-turn rewards and KL
    rewards (`estimators.group_advantages`; records of an older trl_ppo are GAE's)."""
    settings, width = SimpleNamespace(**records[0]["settings"]), mask.size(1)
    shaped = None if records[0].get("shaped_score") is None else torch.tensor([r["shaped_score"] for r in records])
    turns = None if records[0]["turn_rewards"] is None else torch.tensor([r["turn_rewards"] for r in records])
    truncated = torch.tensor([bool(r.get("truncated")) for r in records])  # the logged rewards are before bootstrap
    token_rewards, kl_rewards = padded_rows(records, "rewards", width), padded_rows(records, "non_score_rewards", width)
    return estimators.advantages_for(settings, token_rewards, kl_rewards, shaped, turns,
                                     padded_rows(records, "values", width), mask, truncated)  # fmt: skip


def recompute(records: list[dict]) -> Recomputed:
    """The advantages, returns and losses of one update's records, from their logged rewards, values and masks
    and the settings written with them (no model, no sampling)."""
    settings = records[0]["settings"]
    width = records[0]["response_length"]
    mask = padded_rows(records, "model_mask", width, torch.bool)
    advantages = recompute_advantages(records, mask)
    aggregate = losses.LossAggregation(settings["loss_agg_mode"], None, width)
    logprobs, values = padded_rows(records, "logprobs", width), padded_rows(records, "values", width)
    pg_loss, _ = losses.policy_loss(logprobs, logprobs, advantages.advantages, mask, settings["cliprange"],
                                    aggregate=aggregate)  # fmt: skip
    vf_loss = None
    if values is not None:
        vf_loss, _ = losses.value_loss(values, values, advantages.returns, mask, settings["cliprange_value"],
                                       aggregate)  # fmt: skip
    logged = (padded_rows(records, "advantages", width), padded_rows(records, "returns", width))
    return Recomputed(mask, advantages, *logged, pg_loss, vf_loss)


def trajectories_command(argv: list[str]) -> None:
    """`trl-ppo trajectories FILE`: per update, its episodes, the largest difference between the advantages and
    returns recomputed from the file and those logged, and the losses at the update's start."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="trl-ppo trajectories",
        description="Recompute advantages and losses from a trajectory file (`trl-ppo trajectories view PATH` draws "
        "a run's episodes as a web page).",
    )
    parser.add_argument("file", help="A `trajectories-<rank>.jsonl` written with `--trajectory_dir`.")
    path = parser.parse_args(argv).file
    try:
        updates = read_updates(path)
    except (OSError, ValueError) as error:
        raise SystemExit(f"trl-ppo trajectories: {error}") from None
    print("update  episodes  max|dA|  max|dR|  policy_loss  value_loss")
    for update, records in sorted(updates.items()):
        again = recompute(records)
        d_adv = (again.advantages.advantages - again.logged_advantages).abs().max().item()
        if again.value_loss is None:  # no critic: no returns, no value loss
            d_ret, value_loss = "      -", "         -"
        else:
            d_ret = f"{(again.advantages.returns - again.logged_returns).abs().max().item():7.1e}"
            value_loss = f"{again.value_loss.item():10.4g}"
        print(f"{update:6d}  {len(records):8d}  {d_adv:7.1e}  {d_ret}  {again.policy_loss.item():11.4g}  "
              f"{value_loss}")  # fmt: skip

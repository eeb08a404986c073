"""`trl-ppo trajectories view PATH`: a trajectory file, or a `trajectory_dir` of them, as one self-contained HTML
page (no server, nothing fetched when it opens: it works offline and can be attached to a bug report).

The page shows the updates in order with their mean score, KL and the critic's explained variance; an update's
episodes, sortable and filterable; an episode turn by turn, tool answers set apart, each reward where it landed, and
the model's tokens coloured by a chosen quantity, its number on hover. It is rendered with Jinja2 from
`templates/trajectories.html.j2`, whose small script draws everything from one JSON block of the episodes. Beyond
`max_episodes` episodes a random sample (the same each time) is shown; the update summaries count every episode.
Each update is shown once, from its last copy in a file that a resumed run wrote again (`trajectories.kept_lines`).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
from collections import defaultdict
from importlib import resources

import torch

from .statistics import explained_variance
from .trajectories import iter_records, kept_lines

MAX_EPISODES = 2000  # 2,000 agent episodes of ~150 tokens make a 20 MB page that Chromium opens in about 2 s
# The fields a record needs to be drawn (older files lack `tokens`, `prompt` and the tool counts: drawn without).
REQUIRED = ("update", "response_ids", "model_mask", "turn_starts", "score", "rewards", "logprobs", "ref_logprobs",
            "values", "advantages", "returns")  # fmt: skip
RANK = re.compile(r"trajectories-(\d+)\.jsonl$")


def trajectory_files(path: str) -> list[str]:
    """The trajectory files at `path`: the file itself, or a folder's `trajectories-<rank>.jsonl` by rank."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise ValueError(f"{path} is neither a trajectory file nor a folder of them (a `trajectory_dir`).")
    files = [os.path.join(path, name) for name in os.listdir(path) if RANK.search(name)]
    if not files:
        raise ValueError(f"{path} holds no trajectory file (`trajectories-<rank>.jsonl`, as --trajectory_dir writes).")
    return sorted(files, key=lambda name: int(RANK.search(name).group(1)))


def number(value: float | None) -> float | str | None:
    """A number for the page's JSON, to four significant digits (enough to look at, and a smaller page); NaN and
    infinities, which JSON lacks, as the text JavaScript's `Number()` reads back ("NaN", "Infinity", "-Infinity")."""
    if value is None:
        return None
    if not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return float(f"{value:.4g}")


def numbers(values: list[float]) -> list[float | str]:
    return [number(value) for value in values]


def token_kl(record: dict) -> list[float]:
    """log pi - log pi_ref of each response token (the k1 KL term), 0 outside the model's tokens."""
    pairs = zip(record["logprobs"], record["ref_logprobs"], record["model_mask"])
    return [new - ref if trained else 0.0 for new, ref, trained in pairs]


class UpdateTotals:
    """What an update's summary needs of every one of its episodes, shown or not: the scores, the KL of each, and the
    values and returns on the model's tokens (`[n]` tensors: the records themselves are not kept)."""

    def __init__(self) -> None:
        self.episodes, self.shown, self.scores, self.kls, self.values, self.returns = 0, 0, [], [], [], []

    def add(self, record: dict) -> None:
        mask = torch.tensor(record["model_mask"], dtype=torch.bool)
        self.episodes += 1
        if record["score"] is not None:
            self.scores.append(record["score"])
        self.kls.append(sum(token_kl(record)))
        if record["values"] is not None:  # None: a critic-free estimator, no value function
            self.values.append(torch.tensor(record["values"], dtype=torch.float32)[mask])
            self.returns.append(torch.tensor(record["returns"], dtype=torch.float32)[mask])

    def summary(self, update: int) -> dict:
        """The update's mean score, mean KL per episode (k1) and the critic's explained variance over all its
        episodes (every process's together; the logged `val/explained_variance` is the mean of each process's)."""
        explained = math.nan
        if self.values:
            values, returns = torch.cat(self.values), torch.cat(self.returns)
            explained = explained_variance(values, returns, torch.ones_like(values, dtype=torch.bool)).item()
        return {
            "update": update,
            "episodes": self.episodes,
            "shown": self.shown,
            "score": number(sum(self.scores) / len(self.scores)) if self.scores else None,
            "kl": number(sum(self.kls) / len(self.kls)),
            "explained_variance": None if math.isnan(explained) else number(explained),
        }


def episode_view(record: dict) -> dict:
    """What the page draws of one episode: its row in the table, its tokens and their per-token numbers."""
    kl, values, returns = token_kl(record), record["values"], record["returns"]
    return {
        "update": record["update"],
        "rank": record.get("rank", 0),
        "episode": record.get("episode", 0),
        "score": number(record["score"]),
        "truncated": record.get("truncated"),
        "turns": len(record["turn_starts"]),
        "tool_calls": record.get("tool_calls"),
        "tool_errors": record.get("tool_errors"),
        "model_tokens": sum(record["model_mask"]),
        "kl": number(sum(kl)),
        "prompt": record.get("prompt"),
        "tokens": record.get("tokens") or [f"<{token}>" for token in record["response_ids"]],  # ids: no tokenizer
        "mask": record["model_mask"],
        "turn_rewards": None if record.get("turn_rewards") is None else numbers(record["turn_rewards"]),
        "quantities": {"advantage": numbers(record["advantages"])} | critic_quantities(values, returns) | {
            "KL": numbers(kl),
            "reward": numbers(record["rewards"]),
        },
    }


def critic_quantities(values: list | None, returns: list | None) -> dict:
    """The per-token numbers of the critic (none without one: a critic-free `advantage_estimator`)."""
    if values is None or returns is None:
        return {}
    errors = [value - target for value, target in zip(values, returns)]
    return {"value": numbers(values), "return": numbers(returns), "value error": numbers(errors)}


def page_data(source: str, files: list[str], limit: int, seed: int = 0) -> dict:
    """The page's JSON: the source, the counts, every update's summary and the episodes shown: all of them, or
    beyond `limit` a random sample of `limit` (seeded: the same each time), in update order. The files are read one
    record at a time, and only the episodes shown are kept whole; of an update written twice, only its last copy
    (`kept_lines`)."""
    kept = {path: kept_lines(path) for path in files}
    total = sum(len(lines) for path in files for lines in kept[path])
    chosen = None if total <= limit else set(random.Random(seed).sample(range(total), limit))
    updates, shown, index = defaultdict(UpdateTotals), [], 0
    for path in files:
        for record in iter_records(path, REQUIRED, kept[path]):
            updates[record["update"]].add(record)
            if chosen is None or index in chosen:
                shown.append(episode_view(record))
                updates[record["update"]].shown += 1
            index += 1
    if not updates:
        raise ValueError(f"{', '.join(files)}: no episodes in it.")
    shown.sort(key=lambda episode: episode["update"])  # stable: each update's episodes stay in file order
    return {"source": source, "total": index, "limit": limit, "episodes": shown,
            "updates": [updates[update].summary(update) for update in sorted(updates)]}  # fmt: skip


def render(data: dict) -> str:
    """The HTML page of `page_data`: the template with the data as JSON inside it (`<` escaped, so no text in an
    episode can close the script block)."""
    import jinja2

    template = resources.files("trl_ppo").joinpath("templates/trajectories.html.j2").read_text(encoding="utf-8")
    payload = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")
    return jinja2.Environment(autoescape=True).from_string(template).render(data=data, payload=payload)


def default_output(path: str) -> str:
    """`<trajectory_dir>/trajectories.html`, or the file's name with `.html` beside it."""
    if os.path.isdir(path):
        return os.path.join(path, "trajectories.html")
    return os.path.splitext(path)[0] + ".html"


def view_command(argv: list[str]) -> None:
    """`trl-ppo trajectories view PATH [-o FILE.html] [--max_episodes N]`."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="trl-ppo trajectories view",
        description="Write one self-contained HTML page of a run's trajectories (it opens offline, in any browser): "
        "the updates, their episodes, and each episode's tokens coloured by advantage, value, return, value error "
        "or KL.",
    )
    parser.add_argument("path", help="A `trajectory_dir`, or one of its `trajectories-<rank>.jsonl` files.")
    output_help = "The page to write (default: trajectories.html in the folder, or the file's name with .html)."
    parser.add_argument("-o", "--output", metavar="FILE.html", help=output_help)
    sample_help = "Show at most N episodes, a random sample beyond it (the update summaries count them all)."
    parser.add_argument("--max_episodes", type=int, default=MAX_EPISODES, metavar="N",
                        help=sample_help + " Default: %(default)s.")  # fmt: skip
    args = parser.parse_args(argv)
    output = args.output or default_output(args.path)
    try:
        if args.max_episodes < 1:
            raise ValueError(f"--max_episodes must be at least 1, got {args.max_episodes}.")
        files = trajectory_files(args.path)
        if not os.path.isdir(os.path.dirname(os.path.abspath(output))):
            raise ValueError(f"cannot write {output}: its folder does not exist.")
        data = page_data(args.path, files, args.max_episodes)
        with open(output, "w", encoding="utf-8") as page:
            page.write(render(data))
    except (OSError, ValueError) as error:
        raise SystemExit(f"trl-ppo trajectories view: {error}") from None
    print(f"Wrote {output}: {len(data['updates'])} updates, {len(data['episodes'])} of {data['total']} episodes shown. "
          "Open it in a browser (it needs no network).")  # fmt: skip

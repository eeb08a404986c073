"""Sample completions shown to a person: a rich table in the terminal, and a table in wandb when it reports."""

from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .data import prompts_on_device
from .models import PreparedModels
from .rewards import Scoring, decode_texts
from .rollout import Sampling, chunks, sample_rollout


def print_table(rows: list[dict], title: str, max_rows: int = 10) -> None:
    """Print rows (dicts with the same keys: the columns) as a table, at most `max_rows`; floats with 3 decimals.
    Every cell and the title are plain `Text`: prompts, completions and tool answers are data, and rich would read
    `[/INST]` as a closing tag (a `MarkupError`) and swallow `[tool]` as a style."""
    table = Table(title=Text(title), show_lines=True)
    columns = list(rows[0]) if rows else []
    for column in columns:
        table.add_column(Text(column), overflow="fold")
    for row in rows[:max_rows]:
        table.add_row(*(Text(f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c])) for c in columns))
    Console().print(table)


def log_table_to_wandb(rows: list[dict], step: int, key: str = "completions") -> None:
    """Log the rows as a table named `key` to the active wandb run, if there is one."""
    try:
        import wandb
    except ImportError:
        return
    if wandb.run is None or not rows:
        return
    table = wandb.Table(columns=list(rows[0]))
    for row in rows:
        table.add_data(*row.values())
    wandb.log({key: table, "train/global_step": step})  # the step axis `WandbCallback` uses for its metrics


def show_table(rows: list[dict], title: str, report_to, step: int, key: str = "completions") -> None:
    """The table in the terminal, and in wandb when the run reports there."""
    print_table(rows, title=title)
    if "wandb" in (report_to or []):
        log_table_to_wandb(rows, step=step, key=key)


@torch.no_grad()
def sample_completions(
    dataset,
    count: int,
    batch_size: int,
    collate,
    models: PreparedModels,
    sampling: Sampling,
    scoring: Scoring,
    where: str,
    play=None,
) -> list[dict]:
    """Sample and score a completion for each of the first `count` prompts of `dataset`, `batch_size` at a time
    -> rows of `query`, `model response` and `score` (every process its own rows). `where` labels reward errors.
    `play(batch)`: the rollout of a batch, where it is not one sampled response (multi-turn episodes, whose
    tool answers the table shows marked: `marked_responses`; their `query` is the dataset's prompt, without the
    tools' schemas the episode's prompt is rendered with)."""
    tokenizer = scoring.tokenizer
    rows = []
    for part in chunks(count, batch_size):
        batch = collate([dataset[i] for i in range(part.start, part.stop)])
        queries, query_mask = prompts_on_device(batch, models.accelerator.device, sampling.pad_token_id)
        if play is None:
            rollout = sample_rollout(models, queries, query_mask, sampling)
        else:  # the dataset's prompt is shown: the episode's own lists every tool's JSON schema, the same each row
            rollout = play(batch)
        scores, _ = scoring(rollout, batch, where)
        texts = zip(
            decode_texts(tokenizer, queries, query_mask),
            marked_responses(tokenizer, rollout),
            scores.tolist(),
        )
        rows.extend({"query": q, "model response": r, "score": s} for q, r, s in texts)
    return rows


def marked_responses(tokenizer, rollout) -> list[str]:
    """Each response decoded; where tokens are attended to but not the model's (tool and environment answers of a
    multi-turn episode), each such span is shown as `[tool] ... [/tool]`."""
    if rollout.response_attention_mask is None:
        return decode_texts(tokenizer, rollout.responses, rollout.response_mask)
    texts = []
    for ids, model, attended in zip(rollout.responses, rollout.response_mask, rollout.response_attention_mask):
        ids, model = ids[attended].tolist(), model[attended].tolist()
        spans, start = [], 0
        for end in range(1, len(ids) + 1):
            if end == len(ids) or model[end] != model[start]:
                text = tokenizer.decode(ids[start:end], skip_special_tokens=True)
                spans.append(text if model[start] else f"[tool]{text}[/tool]")
                start = end
        texts.append("".join(spans))
    return texts

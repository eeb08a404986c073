"""Sample completions shown to a person: a rich table in the terminal, and a table in wandb when it reports."""

from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

from . import ppo
from .rewards import decode_texts
from .rollout import Rollout, chunks


def print_table(rows: list[dict], title: str, max_rows: int = 10) -> None:
    """Print rows (dicts with the same keys: the columns) as a table, at most `max_rows`; floats with 3 decimals."""
    table = Table(title=title, show_lines=True)
    columns = list(rows[0]) if rows else []
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows[:max_rows]:
        table.add_row(*(f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in columns))
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


class CompletionsMixin:
    """`generate_completions` for `PPOTrainer`: sample, score and show completions of evaluation prompts."""

    @torch.no_grad()
    def generate_completions(self, sampling: bool = False) -> list[dict]:
        """Sample completions for evaluation prompts and show them with their scores.

        With `sampling=True` (during training) only the first `per_device_eval_batch_size` prompts are used;
        otherwise the whole `eval_dataset` (or, without one, the first prompts of `train_dataset`).
        Returns the rows shown: `query`, `model response`, `score`.
        """
        args = self.args
        dataset = self.eval_dataset if self.eval_dataset is not None else self.train_dataset
        count = min(
            len(dataset), args.per_device_eval_batch_size if sampling or self.eval_dataset is None else len(dataset)
        )
        rows = []
        for part in chunks(count, args.per_device_eval_batch_size):
            batch = self.data_collator([dataset[i] for i in range(part.start, part.stop)])
            queries, query_mask = self._prompts_of(batch)
            responses = self._sample(queries, query_mask)
            rollout = Rollout(
                queries, query_mask, responses, ppo.response_mask_after_stop(responses, self.stop_token_id)
            )
            scores, _ = self.score(rollout, batch)
            texts = zip(
                decode_texts(self.processing_class, queries, query_mask),
                decode_texts(self.processing_class, responses, rollout.response_mask),
                scores.tolist(),
            )
            rows.extend({"query": q, "model response": r, "score": s} for q, r, s in texts)
        if self.accelerator.is_main_process:
            show_table(rows, f"Completions at update {self.state.global_step}", args.report_to, self.state.global_step)
        return rows

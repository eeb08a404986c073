"""Sample completions shown to a person: a rich table in the terminal, and a table in wandb when it reports."""

from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

from . import ppo
from .rewards import decode_texts
from .rollout import Rollout, chunks


def print_completions_table(rows: list[dict], title: str = "Completions", max_rows: int = 10) -> None:
    """Print query / model response / score rows as a table (at most `max_rows`)."""
    table = Table(title=title, show_lines=True)
    table.add_column("query", overflow="fold")
    table.add_column("model response", overflow="fold")
    table.add_column("score", justify="right")
    for row in rows[:max_rows]:
        table.add_row(row["query"], row["model response"], f"{row['score']:.3f}")
    Console().print(table)


def log_completions_to_wandb(rows: list[dict], step: int) -> None:
    """Log the rows as a `completions` table to the active wandb run, if there is one."""
    try:
        import wandb
    except ImportError:
        return
    if wandb.run is None:
        return
    table = wandb.Table(columns=["query", "model response", "score"])
    for row in rows:
        table.add_data(row["query"], row["model response"], row["score"])
    wandb.log({"completions": table}, step=step)


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
            print_completions_table(rows, title=f"Completions at update {self.state.global_step}")
            if "wandb" in (args.report_to or []):
                log_completions_to_wandb(rows, step=self.state.global_step)
        return rows

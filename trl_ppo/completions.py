"""Sample completions shown to a person: a rich table in the terminal, and a table in wandb when it reports."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


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

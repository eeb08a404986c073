"""Prompt datasets: preparation (text, chat messages or token ids -> `input_ids`) and left-padding collation."""

from __future__ import annotations

from typing import Any

import torch


def is_conversational(example: Any) -> bool:
    """Whether a `prompt` value is a list of `{"role", "content"}` messages."""
    return isinstance(example, list) and len(example) > 0 and isinstance(example[0], dict) and "role" in example[0]


def prepare_prompt_dataset(dataset, tokenizer, num_proc: int | None = None):
    """Give every row `input_ids`: kept when present, else tokenized from `prompt`.

    A text `prompt` is tokenized as is; a conversational `prompt` (list of messages) is rendered with the
    tokenizer's chat template and a generation prompt. The other columns are kept (reward functions get them).
    """
    if dataset is None or "input_ids" in dataset.column_names:
        return dataset
    if "prompt" not in dataset.column_names:
        raise ValueError(
            f"The dataset has neither an `input_ids` nor a `prompt` column (columns: {dataset.column_names}). "
            "Add a text or chat-messages `prompt` column, or pre-tokenize prompts into `input_ids`."
        )

    def tokenize(row):
        prompt = row["prompt"]
        if is_conversational(prompt):
            if tokenizer.chat_template is None:
                raise ValueError(
                    "The `prompt` column holds chat messages but the tokenizer has no chat template: set "
                    "`tokenizer.chat_template` or pass plain-text prompts."
                )
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):  # some versions return a BatchEncoding
                ids = ids["input_ids"]
            return {"input_ids": list(ids)}
        return {"input_ids": tokenizer(prompt)["input_ids"]}

    return dataset.map(tokenize, num_proc=num_proc, desc="Tokenizing prompts")


class LeftPaddingCollator:
    """Stacks `input_ids` left-padded (so every prompt ends where the response begins) with an attention mask;
    the other columns pass through as lists."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, rows: list[dict]) -> dict[str, Any]:
        max_length = max(len(row["input_ids"]) for row in rows)
        input_ids = torch.full((len(rows), max_length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), max_length), dtype=torch.long)
        for i, row in enumerate(rows):
            ids = torch.as_tensor(row["input_ids"], dtype=torch.long)
            if ids.numel():
                input_ids[i, -ids.numel() :] = ids
                attention_mask[i, -ids.numel() :] = 1
        batch: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
        for key in rows[0]:
            if key not in batch:
                batch[key] = [row[key] for row in rows]
        return batch

"""Prompt datasets: preparation (text, chat messages or token ids -> `input_ids`) and left-padding collation."""

from __future__ import annotations

from typing import Any

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)


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


class SharedOrderBatchSampler:
    """Batches of dataset indices for one process, in an order every process shares.

    Each epoch is a permutation of the dataset seeded by `seed + epoch`, cut into global batches of
    `local_batch_size * num_processes`; process `process_index` takes its slice of each (an incomplete last
    global batch is dropped). Iteration starts at `(epoch, start_batch)`, so a resumed run continues exactly
    where the interrupted one stopped.
    """

    def __init__(
        self, dataset_length: int, local_batch_size: int, num_processes: int, process_index: int, seed: int
    ) -> None:
        self.local_batch_size = local_batch_size
        self.global_batch_size = local_batch_size * num_processes
        self.offset = process_index * local_batch_size
        self.dataset_length = dataset_length
        self.batches_per_epoch = dataset_length // self.global_batch_size
        self.seed = seed
        self.epoch = 0
        self.start_batch = 0

    def __len__(self) -> int:
        return self.batches_per_epoch - self.start_batch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.dataset_length, generator=generator)
        for batch in range(self.start_batch, self.batches_per_epoch):
            start = batch * self.global_batch_size + self.offset
            yield order[start : start + self.local_batch_size].tolist()


def fit_prompts(dataset, max_prompt_length: int | None, response_length: int, context_length: int | None, name: str):
    """Cut prompts to `max_prompt_length` (keeping their end, next to the response) and check that the longest
    prompt plus `response_length` fits the model's context. Returns the dataset; logs how many prompts were cut."""
    if dataset is None:
        return None
    if max_prompt_length is not None:
        too_long = sum(len(ids) > max_prompt_length for ids in dataset["input_ids"])
        if too_long:
            dataset = dataset.map(lambda row: {"input_ids": row["input_ids"][-max_prompt_length:]})
            logger.warning(
                f"{too_long} of {len(dataset)} prompts in `{name}` were longer than `max_prompt_length` "
                f"({max_prompt_length}) and were cut to their last {max_prompt_length} tokens."
            )
    longest = max((len(ids) for ids in dataset["input_ids"]), default=0)
    if context_length is not None and longest + response_length > context_length:
        raise ValueError(
            f"The longest prompt in `{name}` has {longest} tokens; with `response_length` ({response_length}) that "
            f"exceeds the model's context ({context_length} positions). Set `max_prompt_length` to at most "
            f"{max(context_length - response_length, 0)} to cut long prompts, or lower `response_length`."
        )
    return dataset

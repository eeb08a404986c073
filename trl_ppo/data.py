"""Prompt datasets: preparation (text, chat messages or token ids -> `input_ids`) and left-padding collation."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers.utils import logging

from . import prompt_checks
from .agents.templates import shipped_template_text

logger = logging.get_logger(__name__)


def is_conversational(example: Any) -> bool:
    """Whether a `prompt` value is a list of `{"role", "content"}` messages."""
    return isinstance(example, list) and len(example) > 0 and isinstance(example[0], dict) and "role" in example[0]


def prepare_prompt_dataset(
    dataset, tokenizer, num_proc: int | None = None, name: str = "train_dataset", chat_template: str | None = None
):
    """Give every row `input_ids`: kept when present, else tokenized from `prompt`.

    A text `prompt` is tokenized as is; a conversational `prompt` (list of messages) is rendered with
    `chat_template` (default: the tokenizer's) and a generation prompt (`render_messages`). The other columns are
    kept (reward functions get them).
    """
    if dataset is None or "input_ids" in dataset.column_names:
        return dataset
    if "prompt" not in dataset.column_names:
        raise ValueError(
            f"The dataset has neither an `input_ids` nor a `prompt` column (columns: {dataset.column_names}). "
            "Add a text or chat-messages `prompt` column, or pre-tokenize prompts into `input_ids`."
        )

    def tokenize(row, index):
        prompt = row["prompt"]
        if isinstance(prompt, list):
            text = render_messages(prompt, tokenizer, name, index, chat_template)
            return {"input_ids": tokenizer(text, add_special_tokens=False)["input_ids"]}
        if not isinstance(prompt, str):
            raise ValueError(
                f"Row {index} of `{name}`: `prompt` is {type(prompt).__name__} {prompt!r}; give text or a list of "
                "chat messages."
            )
        return {"input_ids": tokenizer(prompt)["input_ids"]}

    return dataset.map(tokenize, with_indices=True, num_proc=num_proc, desc="Tokenizing prompts")


def render_messages(messages: list, tokenizer, name: str, index: int, chat_template: str | None = None) -> str:
    """Row `index`'s chat messages as text, through `chat_template` (default: the tokenizer's) with a generation
    prompt (what `apply_chat_template(..., tokenize=True)` encodes), checked: roles the template knows, no message
    dropped."""
    template = chat_template or tokenizer.chat_template
    if template is None:
        raise ValueError(
            "The `prompt` column holds chat messages but the tokenizer has no chat template: set "
            "`tokenizer.chat_template` (or, for a ChatML model given tools, `tool_chat_template='chatml'`) or pass "
            "plain-text prompts."
        )
    prompt_checks.check_messages(messages, template, name, index)
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             chat_template=chat_template)  # None: the tokenizer's, by its rules
    except Exception as error:  # jinja's TemplateError, or a template's own `raise_exception(...)`
        raise ValueError(f"Row {index} of `{name}`: the chat template refused its messages: {error}") from error
    prompt_checks.check_rendered(messages, text, name, index)
    return text


def require_pad_token(pad_token_id: int | None, what: str) -> None:
    """Refuse a missing pad token where `what` pads. A trainer given prompts needs it at construction; one built
    for `step()` alone (as trl 0.11's was) only when `generate()` or `step()` pads."""
    if pad_token_id is None:
        raise ValueError(
            f"The tokenizer has no pad token, which {what} needs. Add one, e.g. `tokenizer.pad_token = "
            "tokenizer.eos_token` or `tokenizer.add_special_tokens({'pad_token': '[PAD]'})` (resize the model's "
            "embeddings if the new id is outside them)."
        )


class LeftPaddingCollator:
    """Stacks `input_ids` left-padded (so every prompt ends where the response begins) with an attention mask;
    the other columns pass through as lists."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, rows: list[dict]) -> dict[str, Any]:
        require_pad_token(self.pad_token_id, "this collator (made when the trainer was, without a pad token)")
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
    `local_batch_size / repeats * num_processes` prompts; process `process_index` takes its slice of each (an
    incomplete last global batch is dropped), each prompt `repeats` times in a row (`num_generations`: the samples of
    one prompt, a group, stay whole on one process, TRL GRPO's `RepeatSampler` idea). Iteration starts at
    `(epoch, start_batch)`, so a resumed run continues exactly where the interrupted one stopped.
    """

    def __init__(
        self,
        dataset_length: int,
        local_batch_size: int,
        num_processes: int,
        process_index: int,
        seed: int,
        repeats: int = 1,
    ) -> None:
        self.local_batch_size = local_batch_size // repeats  # prompts, each sampled `repeats` times
        self.repeats = repeats
        self.global_batch_size = self.local_batch_size * num_processes
        self.offset = process_index * self.local_batch_size
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
            prompts = order[start : start + self.local_batch_size]
            yield (prompts if self.repeats == 1 else prompts.repeat_interleave(self.repeats)).tolist()


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
    check_fits_context(longest, response_length, context_length, f"The longest prompt in `{name}` has {longest} tokens")
    return dataset


def check_fits_context(prompt_length: int, response_length: int, context_length: int | None, prompt: str) -> None:
    """Refuse a prompt of `prompt_length` tokens (described by `prompt`) that leaves fewer than `response_length`
    positions of the model's context."""
    if context_length is not None and prompt_length + response_length > context_length:
        raise ValueError(
            f"{prompt}; with `response_length` ({response_length}) that exceeds the model's context "
            f"({context_length} positions). Set `max_prompt_length` to at most "
            f"{max(context_length - response_length, 0)} to cut long prompts, or lower `response_length`."
        )


def shared_order_loader(dataset, args, collate, num_processes: int, process_index: int):
    """This process's batches of `local_batch_size` prompts, in the order seeded by `data_seed` (else `seed`)
    that all processes share -> (DataLoader, its `SharedOrderBatchSampler`, whose position can be set)."""
    seed = args.data_seed if args.data_seed is not None else args.seed
    repeats = getattr(args, "num_generations", 1)
    sampler = SharedOrderBatchSampler(len(dataset), args.local_batch_size, num_processes, process_index, seed, repeats)
    # Its own generator: starting an iterator draws a seed, which must not consume the global RNG (a resumed
    # run starts its iterator at another moment than the run it continues).
    generator = torch.Generator().manual_seed(seed)
    loader = DataLoader(
        dataset, batch_sampler=sampler, collate_fn=collate, num_workers=args.dataloader_num_workers, generator=generator
    )
    return loader, sampler


def prepare_prompts(dataset, tokenizer, args, context_length: int | None, name: str, vocab_size: int | None = None):
    """A dataset of prompts as the trainer uses it: `input_ids` on every row (`prepare_prompt_dataset`; padding
    that an `attention_mask` column marks removed), checked row by row (`prompt_checks`: no empty prompt, no
    padding left in given `input_ids`, ids below `vocab_size`, default: the tokenizer's length), cut to
    `max_prompt_length` and checked against the model's context (`fit_prompts`). None stays None. Chat prompts are
    rendered with the template shipped under `args.tool_chat_template` when one is named, as every episode's prompt
    is then (so a ChatML tokenizer with no template of its own can be given tools)."""
    prompt_checks.check_dataset_type(dataset, name)
    if dataset is None:
        return None
    given_ids = "input_ids" in dataset.column_names
    if given_ids:
        prompt_checks.check_input_ids_type(dataset, name)
        dataset = prompt_checks.strip_masked_padding(dataset, name)
    shipped = getattr(args, "tool_chat_template", None)
    chat_template = shipped_template_text(shipped) if shipped is not None else None
    dataset = prepare_prompt_dataset(dataset, tokenizer, args.dataset_num_proc, name, chat_template)
    if len(dataset) == 0:
        raise ValueError(f"`{name}` is empty: PPO needs prompts to sample from.")
    unmasked = given_ids and "attention_mask" not in dataset.column_names
    prompt_checks.check_rows(dataset, tokenizer, name, check_padding=unmasked)
    check_token_ids(dataset["input_ids"], vocab_size or len(tokenizer), f"`{name}`'s `input_ids`")
    return fit_prompts(dataset, args.max_prompt_length, args.response_length, context_length, name)


def check_token_ids(sequences, vocab_size: int, where: str) -> None:
    """Refuse token ids outside [0, vocab_size) in `sequences` (lists or 1-D tensors of ids), naming the first
    sequence that has one: an embedding lookup would fail later with an index error, or on a GPU a device assert."""
    for index, ids in enumerate(sequences):
        ids = torch.as_tensor(ids)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            bad = ids[(ids < 0) | (ids >= vocab_size)][0].item()
            raise ValueError(
                f"{where}: row {index} holds token id {bad}, outside the policy's vocabulary (ids 0 to "
                f"{vocab_size - 1}). Tokenize with the policy's tokenizer."
            )


def check_datasets(args, train_dataset, eval_dataset) -> None:
    """Refuse, before any compute, datasets that do not fit the config's training and evaluation settings."""
    if args.eval_strategy == "epoch":
        raise ValueError(
            "`eval_strategy='epoch'` is not supported: PPO counts updates, not epochs. Use `eval_strategy='steps'` "
            "with `eval_steps` (in updates)."
        )
    if (args.eval_strategy != "no" or args.eval_on_start) and eval_dataset is None:
        strategy = getattr(args.eval_strategy, "value", args.eval_strategy)
        raise ValueError(
            f"`eval_strategy={strategy}` (or `eval_on_start`) evaluates on `eval_dataset`, and none was given: "
            "pass one, or set `eval_strategy='no'`."
        )
    if train_dataset is None and args.total_episodes is None:
        raise ValueError(
            "Without a `train_dataset` (the `step()` API), set `total_episodes`: it fixes the number of updates "
            "that the learning-rate schedule spans."
        )


def check_one_batch(train_dataset, batch_size: int, samples_per_prompt: int = 1) -> None:
    """Refuse a training set with fewer prompts than one global batch takes (`batch_size`, known once the processes
    are, over `samples_per_prompt`, `num_generations`)."""
    prompts = batch_size // samples_per_prompt
    if train_dataset is not None and len(train_dataset) < prompts:
        per_prompt = f" / num_generations ({samples_per_prompt})" if samples_per_prompt > 1 else ""
        raise ValueError(
            f"`train_dataset` has {len(train_dataset)} prompts, fewer than one batch takes ({prompts} = `batch_size` "
            f"{batch_size} = per_device_train_batch_size * gradient_accumulation_steps * world_size{per_prompt}): "
            "add prompts or lower the batch size."
        )


def prompts_on_device(batch: dict, device: torch.device, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt ids `[B, Lq]`, prompt mask `[B, Lq]` bool) of a collated batch on `device`, checked to be
    left-padded (the response is appended after the last column)."""
    queries = batch["input_ids"].to(device)
    if "attention_mask" in batch:
        query_mask = batch["attention_mask"].to(queries.device).bool()
        ends_in_padding = ~query_mask[:, -1]
    else:  # left padding is the run of pad ids before a row's first other token: a pad id after it (the EOS of
        # a chat turn, when pad = EOS) is part of the prompt; a pad id in the last column is right padding
        query_mask = (queries != pad_token_id).long().cummax(dim=1).values.bool()
        ends_in_padding = queries[:, -1] == pad_token_id
    if bool(ends_in_padding.any()):
        raise ValueError(
            "Prompts must be left-padded (the response is appended after the last column), but this batch has "
            "padding at the end: use the default collator, or a tokenizer with `padding_side='left'`."
        )
    return queries, query_mask


def batches_forever(dataloader, sampler: SharedOrderBatchSampler, run_state):
    """Batches of `dataloader` from `run_state.data_position` = (epoch, batches already taken in it) on, epoch
    after epoch, advancing the position as each batch is taken (so a checkpoint knows where to continue)."""
    while True:
        epoch, start = run_state.data_position
        sampler.epoch, sampler.start_batch = epoch, start
        for taken, batch in enumerate(dataloader, start=start + 1):
            run_state.data_position = (epoch, taken)
            yield batch
        run_state.data_position = (epoch + 1, 0)

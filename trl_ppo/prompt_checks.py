"""Checks of a prompt dataset before any compute: its type, the type of its `input_ids`, padding left in them,
empty prompts, and chat messages the tokenizer's chat template cannot render faithfully. Each error names the
dataset argument, the row and the fix."""

from __future__ import annotations

import datasets

# Roles every chat template is expected to render; any other role must be named in the template's source.
STANDARD_ROLES = ("system", "user", "assistant", "tool")


def check_dataset_type(dataset, name: str) -> None:
    """Refuse anything but a `datasets.Dataset` (or None), saying how to make one from what was given."""
    if dataset is None or isinstance(dataset, datasets.Dataset):
        return
    kind = type(dataset).__name__
    if isinstance(dataset, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        fix = f"pick one split, e.g. `{name}=dataset[{next(iter(dataset), 'train')!r}]` (splits: {list(dataset)})"
    elif isinstance(dataset, datasets.IterableDataset):
        fix = (
            "PPO reads prompts by index in a seeded order (that a resumed run repeats) and needs the dataset's "
            "length: load it without `streaming=True`, or build it with `Dataset.from_generator(...)`"
        )
    elif type(dataset).__module__.startswith("pandas"):
        fix = "convert it with `Dataset.from_pandas(df)`"
    elif isinstance(dataset, dict) or hasattr(dataset, "keys"):  # a dict of columns, or a tokenizer's BatchEncoding
        kind, fix = "dict of columns", "wrap it with `Dataset.from_dict(columns)`"
    elif isinstance(dataset, (list, tuple)):
        kind, fix = "list of rows", "wrap it with `Dataset.from_list(rows)`"
    elif isinstance(dataset, str):
        fix = f"load it first, e.g. `load_dataset({dataset!r}, split='train')` (`from datasets import load_dataset`)"
    else:
        fix = "build one with `Dataset.from_dict({'prompt': texts})` or `Dataset.from_list(rows)`"
    article = "an" if kind[0] in "aeiouAEIOU" else "a"
    raise TypeError(
        f"`{name}` is {article} {kind}; the trainer takes a `datasets.Dataset` (`from datasets import Dataset`), "
        f"each row a `prompt` (text or chat messages) or `input_ids`: {fix}."
    )


def check_input_ids_type(dataset, name: str) -> None:
    """Refuse an `input_ids` column that is not one flat list of integers per row (floats would be truncated)."""
    feature = dataset.features["input_ids"]
    inner = getattr(feature, "feature", None)
    dtype = inner.dtype if isinstance(inner, datasets.Value) else "not a list" if inner is None else "nested lists"
    if dtype == "null" or dtype.startswith(("int", "uint")):
        return  # null: every row is empty, which `check_rows` names
    raise TypeError(
        f"`{name}`'s `input_ids` must hold one list of integer token ids per row, but its type is {feature} "
        f"({dtype}). Tokenize with the policy's tokenizer (`tokenizer(text)['input_ids']`), or cast integral "
        "values with `dataset.cast_column('input_ids', List(Value('int64')))`."
    )


def strip_masked_padding(dataset, name: str):
    """With an `attention_mask` column beside `input_ids` (e.g. from `tokenizer(texts, padding=True)`), keep only
    the tokens it marks 1: the trainer pads prompts itself (on the left). Its 1s must be one run per row."""
    if "attention_mask" not in dataset.column_names:
        return dataset
    for index, (ids, mask) in enumerate(zip(dataset["input_ids"], dataset["attention_mask"])):
        ids, mask = [] if ids is None else list(ids), [] if mask is None else list(mask)
        if len(mask) != len(ids) or not _one_run(mask):
            raise ValueError(
                f"Row {index} of `{name}`: its `attention_mask` {_short(mask)} does not mark one run of tokens in "
                f"its {len(ids)} `input_ids` (0s for padding on either side, 1s for the prompt). Fix the mask, or "
                "drop the `attention_mask` column and give unpadded `input_ids`."
            )

    def unpadded(row):
        kept = [token for token, keep in zip(row["input_ids"], row["attention_mask"]) if keep]
        return {"input_ids": kept, "attention_mask": [1] * len(kept)}

    if all(all(mask) for mask in dataset["attention_mask"]):
        return dataset
    return dataset.map(unpadded, desc=f"Removing the padding that `attention_mask` marks in `{name}`")


def check_rows(dataset, tokenizer, name: str, check_padding: bool) -> None:
    """Every prompt has tokens, and (for `input_ids` given by the user, without an `attention_mask`) none
    `looks_padded`."""
    padded = []
    for index, ids in enumerate(dataset["input_ids"]):
        ids = [] if ids is None else list(ids)
        if not ids:
            raise ValueError(f"Row {index} of `{name}` is an empty prompt{_prompt_of(dataset, index)}: {_EMPTY_FIX}")
        if check_padding and looks_padded(ids, tokenizer):
            padded.append(index)
    if padded:
        raise padding_error(
            tokenizer,
            f"`{name}`'s `input_ids`",
            padded,
            list(dataset[padded[0]]["input_ids"]),
            "Tokenize without padding (`tokenizer(text)['input_ids']` per row), or keep the `attention_mask` column "
            "beside `input_ids`: the trainer then removes what it marks as padding.",
        )


def looks_padded(ids: list, tokenizer) -> bool:
    """Whether prompt ids begin or end with padding, which would be attended to as prompt: the pad id at either end;
    for a pad token that is also the EOS or BOS token (a real prompt may begin or end with one), two in a row."""
    pad = tokenizer.pad_token_id
    return pad is not None and _padding_run(ids, pad) > int(pad in (tokenizer.eos_token_id, tokenizer.bos_token_id))


def padding_error(tokenizer, where: str, rows: list[int], first: list, fix: str) -> ValueError:
    """The error for `rows` of `where` that `looks_padded` (`first`: the ids of the first), with `fix`."""
    repeated = " repeated" if tokenizer.pad_token_id in (tokenizer.eos_token_id, tokenizer.bos_token_id) else ""
    return ValueError(
        f"{len(rows)} row(s) of {where} (first: row {rows[0]}, {_short(first)}) begin or end with the pad token "
        f"{tokenizer.pad_token!r} (id {tokenizer.pad_token_id}){repeated}: they look padded (e.g. `tokenizer(texts, "
        f"padding=True)`), and the pad tokens would be read as prompt. {fix}"
    )


_EMPTY_FIX = "PPO needs at least one token to sample a response after. Remove it (`dataset.filter(...)`) or fill it."


def _one_run(mask) -> bool:
    """Whether a mask holds only 0s and 1s, its 1s (if any) side by side."""
    ones = [i for i, value in enumerate(mask) if value == 1]
    return all(value in (0, 1) for value in mask) and (not ones or ones[-1] - ones[0] + 1 == len(ones))


def _padding_run(ids, pad: int) -> int:
    """The longer of the runs of `pad` at the start and at the end of `ids`."""
    runs = []
    for sequence in (ids, ids[::-1]):
        run = 0
        while run < len(sequence) and sequence[run] == pad:
            run += 1
        runs.append(run)
    return max(runs)


def _prompt_of(dataset, index: int) -> str:
    if "prompt" in dataset.column_names:
        return f" (`prompt` = {_short(dataset[index]['prompt'])} has no tokens)"
    if "attention_mask" in dataset.column_names:
        return " (`input_ids` with an `attention_mask` of 0s only: all padding)"
    return f" (`input_ids` = {dataset[index]['input_ids']!r})"


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_messages(messages, template: str, name: str, index: int) -> None:
    """A conversational prompt's messages: dicts with a text `role` and a `content`, every role one the chat
    template (its source, `template`) knows: a standard role, or one the source names."""
    if not messages:
        raise ValueError(f"Row {index} of `{name}` is an empty prompt (`prompt` = []): {_EMPTY_FIX}")
    template = str(template)
    for position, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or "content" not in message:
            raise ValueError(
                f"Row {index} of `{name}`: message {position} is {_short(message)}; each message must be a dict "
                "with a text `role` and a `content`."
            )
        if role not in STANDARD_ROLES and f"'{role}'" not in template and f'"{role}"' not in template:
            raise ValueError(
                f"Row {index} of `{name}`: message {position} has role {role!r}, which the tokenizer's chat "
                f"template does not name; the model was not trained on it. Use one of {list(STANDARD_ROLES)} "
                "(or a chat template that handles this role)."
            )


def check_rendered(messages, text: str, name: str, index: int) -> None:
    """Refuse a rendering that dropped a message (a template that skips roles it does not handle). Assistant
    turns are not checked: templates may rewrite them (e.g. drop earlier reasoning)."""
    for position, message in enumerate(messages):
        content = message["content"]
        if message["role"] != "assistant":
            check_content_rendered(message, position, text, name, index)
        if message["role"] != "assistant" and isinstance(content, str) and content.strip() not in text:
            raise ValueError(
                f"Row {index} of `{name}`: the chat template left out message {position} (role "
                f"{message['role']!r}, content {_short(content, 40)}); rendered: {_short(text)}. Use a role the "
                "template renders, or fix the template."
            )


def check_content_rendered(message: dict, position: int, text: str, name: str, index: int) -> None:
    """A message whose `content` is not text: None (nothing to say), or a list of parts that the template
    rendered as Python text (a text-only template, e.g. "[{'type': 'text', ...}]") is refused."""
    content, where = message["content"], f"Row {index} of `{name}`: message {position} (role {message['role']!r})"
    if content is None:
        raise ValueError(f"{where} has no content (None); give its text as a string, or leave the message out.")
    if isinstance(content, list) and (not content or "{'type'" in text or '{"type"' in text):
        raise ValueError(
            f"{where} holds a list of parts ({_short(content, 60)}), which the tokenizer's chat template renders as "
            f"Python text: {_short(text)}. This template takes text only: join the parts' text into one string."
        )
    if not isinstance(content, (str, list)):
        raise ValueError(f"{where} has content {_short(content, 40)}; give its text as a string.")

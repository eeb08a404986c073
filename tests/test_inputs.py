"""Prompt datasets as users write them: each mistake fails when the trainer is built (not during an update),
naming the dataset argument, the row and the fix; what a user means (padded `input_ids` with their
`attention_mask`) works."""

import copy

import pytest
from conftest import build_trainer
from datasets import Dataset, DatasetDict

from trl_ppo.data import prepare_prompts

PROMPTS = ["the movie was good", "my day felt long", "our trip", "fun"] * 4


def prepare(dataset, tokenizer, config, name="train_dataset"):
    return prepare_prompts(dataset, tokenizer, config, 128, name)


# ------------------------------------------------------------------------------------ padded input_ids
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_input_ids_are_refused_without_a_mask_and_unpadded_with_one(side, tokenizer, make_config):
    encoded = tokenizer(PROMPTS, padding=True, padding_side=side)
    with pytest.raises(
        ValueError,
        match=r"8 row\(s\) of `train_dataset`'s `input_ids` \(first: row 2, .*begin or "
        r"end with the pad token '\[PAD\]' \(id 0\).*keep the `attention_mask` column",
    ):
        prepare(Dataset.from_dict({"input_ids": encoded["input_ids"]}), tokenizer, make_config())
    prepared = prepare(Dataset.from_dict(dict(encoded)), tokenizer, make_config())
    assert prepared["input_ids"] == tokenizer(PROMPTS)["input_ids"]  # what the mask marked as padding is gone


def test_the_trainer_unpads_input_ids_by_their_attention_mask(make_config, tokenizer, load_models):
    encoded = tokenizer(PROMPTS, padding=True, padding_side="right")
    trainer = build_trainer(make_config(), tokenizer, load_models, Dataset.from_dict(dict(encoded)))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    assert batch["input_ids"][:, -1].tolist() == [ids[-1] for ids in tokenizer(PROMPTS[:4])["input_ids"]]


@pytest.mark.parametrize(
    "mask, message",
    [
        ([1, 0, 1], r"Row 0 of `train_dataset`: its `attention_mask` \[1, 0, 1\] does not mark one run"),
        ([1, 1], r"Row 0 of `train_dataset`: its `attention_mask` \[1, 1\] does not mark one run of tokens in its 3"),
        ([0, 0, 0], r"Row 0 of `train_dataset` is an empty prompt .*`attention_mask` of 0s only"),
    ],
)
def test_an_attention_mask_that_marks_no_single_prompt_is_refused(mask, message, tokenizer, make_config):
    dataset = Dataset.from_dict({"input_ids": [[3, 4, 5]] * 4, "attention_mask": [mask] * 4})
    with pytest.raises(ValueError, match=message):
        prepare(dataset, tokenizer, make_config())


def test_a_pad_token_that_is_also_eos_may_end_a_prompt_once(tokenizer, make_config):
    """Decided: with `pad_token = eos_token` a prompt may end (or begin) with one real EOS (a chat turn's end);
    two or more in a row are padding."""
    pad_is_eos = copy.deepcopy(tokenizer)
    pad_is_eos.pad_token = pad_is_eos.eos_token
    eos = pad_is_eos.eos_token_id
    prepared = prepare(Dataset.from_dict({"input_ids": [[3, 4, eos], [eos, 3]]}), pad_is_eos, make_config())
    assert prepared["input_ids"] == [[3, 4, eos], [eos, 3]]
    with pytest.raises(ValueError, match=rf"row 1, \[3, {eos}, {eos}\]\) begin or end with the pad token '\[EOS\]'"):
        prepare(Dataset.from_dict({"input_ids": [[3, 4, eos], [3, eos, eos]]}), pad_is_eos, make_config())


# ------------------------------------------------------------------------------------------ empty prompts
@pytest.mark.parametrize(
    "column, rows, message",
    [
        ("prompt", PROMPTS[:9] + [""] + PROMPTS[10:], r"Row 9 of `train_dataset` is an empty prompt \(`prompt` = ''"),
        ("prompt", PROMPTS[:12] + ["   "] + PROMPTS[13:], r"Row 12 of `train_dataset` is an empty prompt"),
        ("prompt", [""] * 16, r"Row 0 of `train_dataset` is an empty prompt"),
        ("input_ids", [[3, 4]] * 11 + [[]] + [[3, 4]] * 4, r"Row 11 of `train_dataset` is an empty prompt \(`input"),
        ("input_ids", [[]] * 16, r"Row 0 of `train_dataset` is an empty prompt"),
        ("prompt", [[{"role": "user", "content": "fun"}]] * 15 + [[]], r"Row 15 of `train_dataset` is an empty prom"),
        ("prompt", PROMPTS[:3] + [None] + PROMPTS[4:], r"Row 3 of `train_dataset`: `prompt` is NoneType None"),
    ],
)
def test_an_empty_prompt_anywhere_is_named(column, rows, message, tokenizer, make_config):
    with pytest.raises(ValueError, match=message):
        prepare(Dataset.from_dict({column: rows}), tokenizer, make_config())


def test_an_empty_evaluation_prompt_fails_when_the_trainer_is_built(make_config, tokenizer, load_models):
    evaluation = Dataset.from_dict({"prompt": ["the movie", ""]})
    with pytest.raises(ValueError, match=r"Row 1 of `eval_dataset` is an empty prompt"):
        build_trainer(
            make_config(), tokenizer, load_models, Dataset.from_dict({"prompt": PROMPTS}), eval_dataset=evaluation
        )


# ------------------------------------------------------------------------------ types of input_ids, prompts
@pytest.mark.parametrize(
    "rows, kind",
    [
        ([[3.7, 4.2]] * 4, "float64"),
        ([["3", "4"]] * 4, "string"),
        ([[[3, 4]]] * 4, "nested lists"),
        ([[True, False]] * 4, "bool"),
    ],
)
def test_input_ids_that_are_not_integers_are_refused(rows, kind, tokenizer, make_config):
    with pytest.raises(TypeError, match=rf"`train_dataset`'s `input_ids` must hold one list of integer.*\({kind}\)"):
        prepare(Dataset.from_dict({"input_ids": rows}), tokenizer, make_config())


def test_a_prompt_that_is_neither_text_nor_messages_is_named(tokenizer, make_config):
    with pytest.raises(ValueError, match=r"Row 0 of `train_dataset`: `prompt` is int 3; give text or a list"):
        prepare(Dataset.from_dict({"prompt": [3, 4]}), tokenizer, make_config())
    with pytest.raises(ValueError, match=r"Row 0 of `train_dataset`: message 0 is 'the movie'; each message must"):
        prepare(Dataset.from_dict({"prompt": [["the movie", "was"]]}), tokenizer, make_config())


def chat(*roles):
    messages = [{"role": role, "content": f"the movie {i}"} for i, role in enumerate(roles)]
    return Dataset.from_dict({"prompt": [messages] * 4})


def test_chat_roles_the_template_does_not_know_are_refused(tokenizer, make_config):
    with pytest.raises(
        ValueError,
        match=r"Row 0 of `train_dataset`: message 1 has role 'bot', which the tokenizer's "
        r"chat template does not name",
    ):
        prepare(chat("user", "bot"), tokenizer, make_config())
    prepare(chat("system", "user", "assistant", "tool", "user"), tokenizer, make_config())  # the standard roles
    named = copy.deepcopy(tokenizer)
    named.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'observation' %}:{% endif %}{{ m['content'] }}{% endfor %}"
    )
    prepare(chat("observation"), named, make_config())  # a template that names its own role


def test_a_template_that_drops_or_refuses_a_message_is_named(tokenizer, make_config):
    users_only = copy.deepcopy(tokenizer)
    users_only.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    with pytest.raises(
        ValueError,
        match=r"Row 0 of `train_dataset`: the chat template left out message 0 \(role "
        r"'system'",
    ):
        prepare(chat("system", "user"), users_only, make_config())
    refusing = copy.deepcopy(tokenizer)
    refusing.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}{% endfor %}"
    )
    with pytest.raises(ValueError, match=r"Row 0 of `train_dataset`: the chat template refused .*System role not"):
        prepare(chat("system", "user"), refusing, make_config())


# -------------------------------------------------------------------------------------- dataset containers
@pytest.mark.parametrize("name", ["train_dataset", "eval_dataset"])
def test_other_dataset_containers_say_how_to_get_a_dataset(name, tokenizer, make_config):
    pandas = pytest.importorskip("pandas")
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    cases = [
        (pandas.DataFrame({"prompt": PROMPTS}), r"is a DataFrame.*`Dataset.from_pandas\(df\)`"),
        (DatasetDict({"train": dataset}), rf"is a DatasetDict.*`{name}=dataset\['train'\]` \(splits: \['train'\]\)"),
        (dataset.to_iterable_dataset(), r"is an IterableDataset.*without `streaming=True`"),
        ("imdb", r"is a str.*`load_dataset\('imdb', split='train'\)`"),
    ]
    for given, message in cases:
        with pytest.raises(TypeError, match=rf"`{name}` {message}"):
            prepare(given, tokenizer, make_config(), name)

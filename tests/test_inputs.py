"""Prompt datasets and reward functions as users write them: each mistake fails when the trainer is built (not
during an update), naming the dataset argument, the row or the reward, and the fix; what a user means (padded
`input_ids` with their `attention_mask`, a reward without `**columns`) works."""

import copy

import pytest
import torch
from conftest import build_trainer
from datasets import Dataset, DatasetDict

from trl_ppo import PPOTrainer
from trl_ppo.data import prepare_prompts
from trl_ppo.reward_functions import reward_function_scores

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


def test_step_refuses_padded_queries(make_config, tokenizer, load_models):
    trainer = build_trainer(make_config(total_episodes=80), tokenizer, load_models)
    queries = list(tokenizer(PROMPTS[:8], padding=True, return_tensors="pt").input_ids)  # left-padded
    with pytest.raises(ValueError, match=r"4 row\(s\) of `step\(\)`'s `queries` \(first: row 2, \[0, 0, .*pad token"):
        trainer.step(queries, [torch.tensor([3, 4])] * 8, [1.0] * 8)


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


# --------------------------------------------------------------------------------------- argument names
@pytest.mark.parametrize(
    "old, new",
    [
        ("tokenizer", "`processing_class=`"),
        ("config", "`args=`"),
        ("policy", "`model=`"),
        ("ref_policy", "`ref_model=`"),
        ("dataset", "`train_dataset=`.*trl_ppo.legacy.PPOTrainer"),
    ],
)
def test_argument_names_of_older_trl_releases_say_the_new_name(old, new):
    with pytest.raises(TypeError, match=rf"PPOTrainer: `{old}=` is the name in older TRL releases; pass {new}"):
        PPOTrainer(model=None, ref_model=None, **{old: None})
    with pytest.raises(TypeError, match=r"there is no argument `reward_models=`: did you mean `reward_model=`\?"):
        PPOTrainer(args=None, processing_class=None, model=None, ref_model=None, reward_models=None)


def test_trl_011_config_given_as_args_points_to_the_legacy_trainer(tokenizer):
    from trl_ppo.legacy import PPOConfig as LegacyConfig

    with pytest.raises(TypeError, match=r"got trl_ppo.legacy.config.PPOConfig.*use `trl_ppo.legacy.PPOTrainer`"):
        PPOTrainer(LegacyConfig(), tokenizer, None, None)


# ------------------------------------------------------------------------------------- reward functions
def test_a_reward_function_gets_only_the_arguments_it_names():
    columns = {"prompt": ["p"] * 2, "reference": ["r"] * 2}
    for function in (
        lambda prompts, completions: [1.0] * len(completions),
        lambda completions: [1.0] * len(completions),
        lambda *, completions, reference=None: [1.0] * len(completions),
    ):
        scores, _ = reward_function_scores(function, "f", ["p"] * 2, ["c"] * 2, columns, "cpu")
        assert scores.tolist() == [1.0, 1.0]


def test_a_reward_without_columns_scores_a_batch(make_config, tokenizer, load_models):
    def brief(prompts, completions):
        return [-float(len(c.split())) for c in completions]

    trainer = build_trainer(make_config(), tokenizer, load_models, Dataset.from_dict({"prompt": PROMPTS}), reward=brief)
    batch = next(iter(trainer.train_dataloader))
    scores, _ = trainer.score(trainer.collect_rollout(batch), batch)
    assert scores.shape == (8,)


def test_a_reward_requiring_what_a_dataset_lacks_fails_when_the_trainer_is_built(make_config, tokenizer, load_models):
    def exact(prompts, completions, reference):
        return [float(c == r) for c, r in zip(completions, reference)]

    train = Dataset.from_dict({"prompt": PROMPTS, "reference": PROMPTS})
    with pytest.raises(
        ValueError,
        match=r"Reward function 'exact' requires 'reference'.*columns of `eval_dataset` "
        r"\(prompt\)",
    ):
        build_trainer(
            make_config(),
            tokenizer,
            load_models,
            train,
            reward=exact,
            eval_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        )
    trainer = build_trainer(make_config(), tokenizer, load_models, train, reward=exact)
    with pytest.raises(ValueError, match=r"^Reward function 'exact' requires 'reference'.*of `eval_dataset`"):
        trainer.evaluate(Dataset.from_dict({"prompt": PROMPTS}))  # before sampling, not in its scoring
    with pytest.raises(ValueError, match=r"Reward function '<lambda>' requires 'p', 'c'.*add `\*\*columns`"):
        build_trainer(make_config(), tokenizer, load_models, train, reward=lambda p, c: [0.0] * len(c))


def score_two_episodes(rewards, tokenizer, columns=None):
    """`Scoring` as an update uses it ("Update 1"), on two hand-made episodes: no model, no sampling."""
    from trl_ppo.rewards import Scoring, build_rewards
    from trl_ppo.step_api import rollout_of

    rollout = rollout_of([torch.tensor([3, 4])] * 2, [torch.tensor([5, 6])] * 2, tokenizer.pad_token_id, "cpu")
    return Scoring(build_rewards(rewards), tokenizer, 2, None, None)(rollout, dict(columns or {}), "Update 1")


def test_each_reward_gets_its_own_copy_of_the_lists(tokenizer):
    seen = {}

    def vandal(prompts, completions, **columns):
        completions.clear()
        columns["reference"][0] = "changed"
        return [1.0] * len(prompts)

    def reader(prompts, completions, reference):
        seen.update(completions=list(completions), reference=list(reference))
        return [0.0] * len(completions)

    batch = {"reference": ["first", "second"]}
    score_two_episodes([vandal, reader], tokenizer, batch)
    assert len(seen["completions"]) == 2 and seen["reference"] == ["first", "second"] == batch["reference"]


def test_rewards_get_the_episodes_environments_themselves_not_copies(tokenizer):
    """An environment may hold what cannot be copied (a lock, a socket, a process); a reward reads its state."""
    import threading

    class Terminal:
        def __init__(self):
            self.lock, self.commands = threading.Lock(), ["ls"]

    environments = [Terminal(), Terminal()]
    seen = []

    def any_columns(prompts, completions, **columns):
        seen.append(columns["environments"])
        return [0.0] * len(completions)

    def named(completions, environments):
        seen.append(environments)
        return [float(len(e.commands)) for e in environments]

    score_two_episodes([any_columns, named], tokenizer, {"environments": environments})
    assert len(seen) == 2 and all(a is b for got in seen for a, b in zip(got, environments))


def test_a_huge_score_names_the_reward_and_the_update(make_config, tokenizer, load_models):
    def huge(prompts, completions):
        return [1e30] * len(completions)

    with pytest.raises(ValueError, match=r"^Update 1: Reward 'huge' returned 2 score\(s\) beyond ±1e\+10 .*1e\+30"):
        score_two_episodes([huge], tokenizer)
    score_two_episodes([lambda completions: [1e9] * 2], tokenizer)  # large, but allowed
    trainer = build_trainer(make_config(total_episodes=80), tokenizer, load_models)
    queries = [torch.tensor([3, 4])] * 8
    with pytest.raises(ValueError, match=r"`step\(\)` got a score of -1e\+30, beyond ±1e\+10"):
        trainer.step(queries, queries, [1.0] * 7 + [-1e30])


def test_an_error_inside_a_reward_function_keeps_its_type_and_names_the_reward(tokenizer):
    def lookup(prompts, completions):
        return [{"good": 1.0}[c] for c in completions]

    with pytest.raises(KeyError) as raised:
        score_two_episodes([lookup], tokenizer)
    assert raised.value.__notes__ == ["Raised by reward function 'lookup'.", "Update 1, while scoring."]

    def strict(prompts, completions):
        raise ValueError("no judge available")

    with pytest.raises(ValueError, match=r"^Update 1: Reward function 'strict' raised: no judge available$"):
        score_two_episodes([strict], tokenizer)

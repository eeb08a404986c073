"""PPO on TL;DR summarisation prompts (a `prompt` column of Reddit posts ending in "TL;DR:").

    accelerate launch --config_file examples/accelerate_configs/deepspeed_zero2.yaml \
        examples/scripts/ppo_tldr.py \
        --output_dir pythia-1b-tldr-ppo \
        --learning_rate 3e-6 \
        --per_device_train_batch_size 16 \
        --gradient_accumulation_steps 4 \
        --total_episodes 1000000 \
        --model_name_or_path EleutherAI/pythia-1b-deduped \
        --sft_model_path cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr \
        --reward_model_path cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr \
        --local_rollout_forward_batch_size 16

Defaults below (the trl-lib/tldr dataset, EOS as stop token, a missing-EOS penalty of 1.0) are ordinary flags:
any flag you pass wins, e.g. `--dataset_name my_prompts.jsonl` for a local file with a `prompt` column.
Without --model_name_or_path the tiny embedded default job runs instead.
"""

import sys

from trl_ppo.cli import main
from trl_ppo.config_file import with_config_file
from trl_ppo.script_args import as_flags

TLDR_SETTINGS = {
    "dataset_name": "trl-lib/tldr",
    "dataset_test_split": "validation",
    "stop_token": "eos",
    "missing_eos_penalty": 1.0,
    "response_length": 53,
}
TLDR_FLAGS = as_flags(TLDR_SETTINGS)

if __name__ == "__main__":
    argv = with_config_file(sys.argv[1:])  # a --config file's options, so that the TL;DR defaults stay lowest
    # The TL;DR data lives on the hub: the offline default job (no model given) keeps its own prompts.
    uses_hub_models = any(arg.split("=")[0] == "--model_name_or_path" for arg in argv)
    main((TLDR_FLAGS if uses_hub_models else []) + argv)

"""PPO on a prompt dataset, with the PPOv2 flags you know from TRL.

Without --model_name_or_path it trains the tiny embedded default (offline, about half a minute on 2 CPU cores):

    python examples/scripts/ppo.py

With real models (hub names or local folders) and a dataset (hub name or a local .json/.jsonl/.parquet file
with a `prompt` or `input_ids` column):

    python examples/scripts/ppo.py \
        --dataset_name trl-internal-testing/descriptiveness-sentiment-trl-style \
        --dataset_train_split descriptiveness \
        --learning_rate 3e-6 \
        --output_dir pythia-1b-deduped-descriptiveness-sentiment-ppo \
        --per_device_train_batch_size 64 \
        --gradient_accumulation_steps 1 \
        --total_episodes 10000 \
        --model_name_or_path EleutherAI/pythia-1b-deduped \
        --sft_model_path EleutherAI/pythia-1b-deduped \
        --reward_model_path EleutherAI/pythia-1b-deduped \
        --stop_token eos \
        --missing_eos_penalty 1.0

    accelerate launch --config_file examples/accelerate_configs/deepspeed_zero3.yaml \
        examples/scripts/ppo.py --model_name_or_path ... (same flags)
"""

from trl_ppo.cli import main

if __name__ == "__main__":
    main()

"""Episodes per second and peak memory of trl_ppo's PPO loop on random-init GPT-NeoX shapes.

    python benchmark/bench_ppo.py --shape tiny                 # CPU, seconds
    python benchmark/bench_ppo.py --shape 160m --precision bf16 # GPU
    accelerate launch --config_file examples/accelerate_configs/deepspeed_zero3.yaml --num_processes 1 \
        benchmark/bench_ppo.py --shape 160m --precision bf16     # under DeepSpeed ZeRO-3 (or ZeRO-2, DDP, ...)

Same setup as the reference figures in the project's issues: batch 64 (16 x 4 accumulation), 4 PPO epochs,
`response_length` 53, prompts of 32-64 random tokens, a reward model of the policy's shape. Throughput is
measured in steady state: the first update (warm-up) is excluded. Under several processes, episodes/s counts all
processes' episodes and the memory is the main process's. Results go to benchmark/RESULTS.md by hand, with the
command and the machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import torch
from datasets import Dataset
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXForSequenceClassification, TrainerCallback

from trl_ppo import PPOConfig, PPOTrainer
from trl_ppo.default_job import build_word_tokenizer
from trl_ppo.distributed import deepspeed_zero_stage

SHAPES = {  # hidden size, layers, heads (pythia family), vocabulary 50304
    "tiny": (64, 2, 4, 512),
    "160m": (768, 12, 12, 50304),
    "410m": (1024, 24, 16, 50304),
    "1b": (2048, 16, 8, 50304),
}


class UpdateTimer(TrainerCallback):
    def __init__(self) -> None:
        self.times = [time.perf_counter()]

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())


def build_models(shape: str, tokenizer, dtype):
    hidden, layers, heads, vocab = SHAPES[shape]
    config = GPTNeoXConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=2048,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    # The reference is the trainer's frozen copy of the policy (ref_model=None), as in a real run.
    return (
        GPTNeoXForCausalLM(config).to(dtype),
        GPTNeoXForSequenceClassification(config).to(dtype),
        GPTNeoXForSequenceClassification(config).to(dtype),
    )


def random_prompts(vocab: int, count: int, seed: int = 0) -> Dataset:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(32, 65, (count,), generator=generator)
    return Dataset.from_dict(
        {"input_ids": [torch.randint(3, vocab, (int(n),), generator=generator).tolist() for n in lengths]}
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--updates", type=int, default=4, help="Updates measured after the warm-up update.")
    parser.add_argument("--per_device_train_batch_size", type=int, default=16)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=4)
    parser.add_argument("--output_dir", default="/tmp/trl_ppo_bench")
    parser.add_argument("--ddp_backend", default=None, help="e.g. gloo for DeepSpeed on CPU.")
    cli = parser.parse_args()

    tokenizer = build_word_tokenizer()
    batch = cli.per_device_train_batch_size * cli.gradient_accumulation_steps
    policy, value_model, reward_model = build_models(cli.shape, tokenizer, torch.float32)
    on_gpu = torch.cuda.is_available()
    config = PPOConfig(
        output_dir=cli.output_dir,
        per_device_train_batch_size=cli.per_device_train_batch_size,
        gradient_accumulation_steps=cli.gradient_accumulation_steps,
        total_episodes=batch * (cli.updates + 1),
        num_ppo_epochs=4,
        response_length=53,
        local_rollout_forward_batch_size=batch,
        num_sample_generations=0,
        save_strategy="no",
        report_to="none",
        logging_steps=1,
        bf16=cli.precision == "bf16",
        use_cpu=not on_gpu,
        disable_tqdm=True,
        ddp_backend=cli.ddp_backend,
    )
    timer = UpdateTimer()
    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=None,
        reward_model=reward_model,
        value_model=value_model,
        train_dataset=random_prompts(SHAPES[cli.shape][3], batch * 2),
        callbacks=[timer],
    )
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    steady = timer.times[2:]  # end of the warm-up update onwards
    seconds = steady[-1] - timer.times[1]
    batch = config.batch_size  # all processes' episodes per update
    result = {
        "shape": cli.shape,
        "precision": cli.precision,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "episodes_per_second": round(batch * (len(steady)) / seconds, 2),
        "seconds_per_update": round(seconds / len(steady), 3),
        "peak_memory_gib": round(
            (torch.cuda.max_memory_allocated() if on_gpu else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
            / 2**30,
            2,
        ),
        "peak_memory_kind": "cuda_max_allocated" if on_gpu else "max_rss",
        "processes": trainer.accelerator.num_processes,
        "deepspeed_zero_stage": deepspeed_zero_stage(trainer.accelerator),
        "torch": torch.__version__,
    }
    if trainer.accelerator.is_main_process:
        json.dump(result, sys.stdout)
        print()


if __name__ == "__main__":
    main()

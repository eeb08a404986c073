"""Multi-turn episodes in several processes (issue 25, semantic 5), launched with `accelerate launch`:

    accelerate launch ... tests/scripts/agents_distributed_run.py --report_dir DIR [any PPOConfig flag]

Process 0's episodes all end after their first turn; process 1's call a tool every turn up to `max_turns`. The
turns are scripted, but each one first calls the run's real sampler (under ZeRO-3 a collective), so a process
that stopped sampling early would hang the other. Each process writes `DIR/rank<i>.json` (its log history and
how many times it called the sampler) and `DIR/weights_rank<i>.pt`.
"""

import json
import os
from dataclasses import dataclass, field

import torch

torch.set_num_threads(1)  # one thread per process: two processes share the two cores

from datasets import Dataset  # noqa: E402
from distributed_run import exit_at_once, full_weights  # noqa: E402
from transformers import AutoModelForCausalLM, HfArgumentParser, Qwen2Config  # noqa: E402

from trl_ppo import PPOConfig, PPOTrainer  # noqa: E402
from trl_ppo.agents import runner  # noqa: E402
from trl_ppo.agents.tiny_chat import build_tool_tokenizer  # noqa: E402

CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call><|im_end|>'


@dataclass
class RunArgs:
    report_dir: str = field(metadata={"help": "Where each process writes its report and weights."})


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


def main() -> None:
    tokenizer = build_tool_tokenizer()
    model_config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=2048, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(model_config)  # before the config: ZeRO-3 would partition it
    run_args, config = HfArgumentParser((RunArgs, PPOConfig)).parse_args_into_dataclasses()
    prompts = [[{"role": "user", "content": f"What is {i} * 7?"}] for i in range(16)]
    calls = []

    def scripted(models, sampling):
        real = real_sampler(models, sampling)
        rank = models.accelerator.process_index

        def sample_turn(contexts, max_new_tokens):
            real(contexts, 1)  # the run's sampler, as a collective where it is one
            calls.append(len(contexts))
            text = "It is 42.<|im_end|>" if rank == 0 else CALL
            return [tokenizer.encode(text, add_special_tokens=False)[:max_new_tokens] for _ in contexts]

        return sample_turn

    real_sampler, runner.turn_sampler = runner.turn_sampler, scripted
    runner.AgentRunner._lockstep = True  # the script is the lockstep loop's sampler
    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=None,
        reward_model=[lambda prompts, completions, **columns: [float(len(c) % 7) for c in completions]],
        value_model=None,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        tools=[multiply],
    )
    trainer.train()
    weights = full_weights(trainer)
    rank = trainer.accelerator.process_index
    os.makedirs(run_args.report_dir, exist_ok=True)
    torch.save(weights, os.path.join(run_args.report_dir, f"weights_rank{rank}.pt"))
    report = {"rank": rank, "log_history": trainer.state.log_history, "sampler_calls": calls}
    with open(os.path.join(run_args.report_dir, f"rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(report, handle)
    trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
    exit_at_once()

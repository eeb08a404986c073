"""A tiny PPO run for tests/test_user_code_distributed.py, launched with `accelerate launch` on two CPU processes:
its reward function never returns on rank 1 from update `--hang_from` on (a judge that stopped answering there).

    accelerate launch ... tests/scripts/hung_reward_run.py --report_dir DIR --hang_from N [any PPOConfig flag]

Each process writes `DIR/rank<i>.json`: how `train()` (or `PPOTrainer(...)`) ended (the error's type and message,
or "finished"), the updates done, and the seconds from the start of `train()`."""

import json
import os
import sys
import time
from dataclasses import dataclass, field

import torch

torch.set_num_threads(1)  # one thread per process: two processes share the two cores

from transformers import HfArgumentParser  # noqa: E402

from trl_ppo import PPOConfig, PPOTrainer  # noqa: E402
from trl_ppo.default_job import build_tiny_models, build_word_tokenizer, default_prompts  # noqa: E402


@dataclass
class RunArgs:
    report_dir: str = field(metadata={"help": "Where each process writes its report."})
    hang_from: int = field(default=1, metadata={"help": "The update from which rank 1's reward never returns."})


def main() -> None:
    run_args, config = HfArgumentParser((RunArgs, PPOConfig)).parse_args_into_dataclasses()
    rank = int(os.environ.get("RANK", "0"))
    calls = []

    def judge(prompts, completions, **columns):
        calls.append(1)
        if rank == 1 and len(calls) >= run_args.hang_from:
            time.sleep(3600)
        return [len(completion.split()) / 10 for completion in completions]

    report = {"rank": rank, "updates": 0}
    start = time.monotonic()
    try:
        tokenizer = build_word_tokenizer()
        policy, value_model = build_tiny_models(tokenizer, hidden_size=32, seed=0)
        trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=None,
                             reward_model=judge, value_model=value_model, train_dataset=default_prompts())
        start = time.monotonic()
        try:
            trainer.train()
            report["ended"] = "finished"
        finally:
            report["updates"] = trainer.state.global_step
    except Exception as error:  # what the test checks: the error each process ends with
        report["ended"] = f"{type(error).__name__}: {error}"
    report["seconds"] = time.monotonic() - start
    os.makedirs(run_args.report_dir, exist_ok=True)
    with open(os.path.join(run_args.report_dir, f"rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(report, handle)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no teardown of the process group: the other process may have stopped already


if __name__ == "__main__":
    main()

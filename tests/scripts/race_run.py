"""One of two processes that start `train()` in the same `output_dir` at the same moment, for
tests/test_run_lock.py:

    python race_run.py ROOT RANK TRIALS

For each trial i, both processes build their trainer for ROOT/trial-<i>, meet at a file barrier, then train (two
updates, a checkpoint after each). Each writes ROOT/result-<i>-<RANK>.json: "ok", or the error's type and text.
"""

import json
import os
import sys
import time

from trl_ppo import PPOConfig, PPOTrainer
from trl_ppo.default_job import build_tiny_models, build_word_tokenizer, default_prompts, sentiment_reward

root, rank, trials = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tokenizer = build_word_tokenizer()
prompts = default_prompts().select(range(16))


def barrier(name: str) -> None:
    open(os.path.join(root, f"{name}-{rank}"), "w").close()
    other = os.path.join(root, f"{name}-{1 - rank}")
    deadline = time.time() + 120
    while not os.path.exists(other) and time.time() < deadline:
        time.sleep(0.0005)


for trial in range(trials):
    config = PPOConfig(
        output_dir=os.path.join(root, f"trial-{trial}"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        num_ppo_epochs=1,
        total_episodes=8,
        response_length=4,
        num_sample_generations=0,
        save_strategy="steps",
        save_steps=1,
        report_to="none",
        seed=rank,
        disable_tqdm=True,
    )
    policy, value_model = build_tiny_models(tokenizer, hidden_size=16, num_layers=1)
    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=None,
        reward_model=sentiment_reward,
        value_model=value_model,
        train_dataset=prompts,
    )
    barrier(f"ready-{trial}")
    try:
        trainer.train()
        result = {"outcome": "ok", "run_id": trainer.run.run_id}
    except Exception as error:  # what the test judges
        result = {"outcome": type(error).__name__, "message": str(error)}
    with open(os.path.join(root, f"result-{trial}-{rank}.json"), "w") as handle:
        json.dump(result, handle)
    barrier(f"done-{trial}")  # the next trial starts together again

"""A small, deterministic PPO run for the preemption test: `python preemptible_run.py OUTPUT_DIR [resume]`.

Prints `UPDATE <n>` after each update so that the test knows when to send SIGTERM, and at the end the final
weights' digest, so that runs in different processes can be compared.
"""

import hashlib
import sys

import torch
from transformers import TrainerCallback

torch.set_num_threads(1)  # identical float reductions in every process

from trl_ppo import PPOConfig, PPOTrainer  # noqa: E402
from trl_ppo.default_job import build_tiny_models, build_word_tokenizer, default_prompts, positive_words_reward  # noqa: E402


class Announce(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        print(f"UPDATE {state.global_step}", flush=True)


def weights_digest(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def tiny_trainer(output_dir: str, callbacks: list, hidden_size: int = 64, **overrides) -> PPOTrainer:
    """The default job's tokenizer, prompts and positive-words reward on tiny models, with this run's settings
    (`overrides` win); also used by the other subprocess scripts."""
    tokenizer = build_word_tokenizer()
    policy, value_model = build_tiny_models(tokenizer, hidden_size=hidden_size)
    settings = dict(
        output_dir=output_dir,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        total_episodes=16 * 8,
        response_length=16,
        num_ppo_epochs=2,
        learning_rate=1e-3,
        num_sample_generations=0,
        logging_steps=1,
        save_strategy="steps",
        save_steps=3,
        report_to="none",
        seed=11,
        stop_token="eos",
        disable_tqdm=True,
    )
    return PPOTrainer(
        args=PPOConfig(**{**settings, **overrides}),
        processing_class=tokenizer,
        model=policy,
        ref_model=None,
        reward_model=positive_words_reward,
        value_model=value_model,
        train_dataset=default_prompts(),
        callbacks=callbacks,
    )


if __name__ == "__main__":
    output_dir, resume = sys.argv[1], len(sys.argv) > 2
    trainer = tiny_trainer(output_dir, [Announce()])
    trainer.train(resume_from_checkpoint=True if resume else None)
    wrapper = trainer.accelerator.unwrap_model(trainer.model)
    print("POLICY", weights_digest(wrapper.policy), flush=True)
    print("VALUE", weights_digest(wrapper.value_model), flush=True)
    print("SCORES", [round(e["objective/scores"], 6) for e in trainer.state.log_history if "objective/scores" in e])

"""A run whose second checkpoint meets a real write error: `python write_error_run.py OUTPUT_DIR [resume]`.

Before checkpoint-2 is written, the process's file-size limit (RLIMIT_FSIZE) drops to 4 KiB, so writing the
policy's weights fails in the OS as on a full disk (EFBIG instead of ENOSPC; SIGXFSZ is ignored so that the
write returns the error). With `resume`, no limit is set and the run resumes from its newest checkpoint.
"""

import resource
import signal
import sys

from transformers import TrainerCallback

from trl_ppo import PPOConfig, PPOTrainer
from trl_ppo.default_job import build_tiny_models, build_word_tokenizer, default_prompts, positive_words_reward


class LimitFileSizeBeforeSecondSave(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


if __name__ == "__main__":
    output_dir, resume = sys.argv[1], len(sys.argv) > 2
    tokenizer = build_word_tokenizer()
    policy, value_model = build_tiny_models(tokenizer, hidden_size=32)
    config = PPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        total_episodes=3 * 8,
        response_length=8,
        num_ppo_epochs=1,
        num_sample_generations=0,
        save_strategy="steps",
        save_steps=1,
        report_to="none",
        seed=5,
        stop_token="eos",
        disable_tqdm=True,
    )
    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=None,
        reward_model=positive_words_reward,
        value_model=value_model,
        train_dataset=default_prompts(),
        callbacks=[] if resume else [LimitFileSizeBeforeSecondSave()],
    )
    trainer.train(resume_from_checkpoint=True if resume else None)
    print("DONE", trainer.state.global_step, flush=True)

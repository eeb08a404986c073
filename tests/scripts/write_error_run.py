"""A run whose second checkpoint meets a real write error: `python write_error_run.py OUTPUT_DIR [resume]`.

Before checkpoint-2 is written, the process's file-size limit (RLIMIT_FSIZE) drops to 4 KiB, so writing the
policy's weights fails in the OS as on a full disk (EFBIG instead of ENOSPC; SIGXFSZ is ignored so that the
write returns the error). With `resume`, no limit is set and the run resumes from its newest checkpoint.
"""

import resource
import signal
import sys

from preemptible_run import tiny_trainer
from transformers import TrainerCallback


class LimitFileSizeBeforeSecondSave(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


if __name__ == "__main__":
    output_dir, resume = sys.argv[1], len(sys.argv) > 2
    callbacks = [] if resume else [LimitFileSizeBeforeSecondSave()]
    settings = dict(per_device_train_batch_size=4, total_episodes=3 * 8, response_length=8, num_ppo_epochs=1)
    trainer = tiny_trainer(output_dir, callbacks, hidden_size=32, save_steps=1, seed=5, **settings)
    trainer.train(resume_from_checkpoint=True if resume else None)
    print("DONE", trainer.state.global_step, flush=True)

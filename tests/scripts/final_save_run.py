"""The default job (`trl-ppo`, 4 updates) with a fault injected at one moment of the end of a run, for
tests/test_final_save.py:

    python final_save_run.py OUTPUT_DIR MOMENT

MOMENT: `last_update` (SIGTERM to itself during the last update's rollout), `curves` (SIGTERM while the curves
are drawn), `save` (SIGTERM while the final model is written), `full_disk` (drawing the curves and writing the
model card fail with ENOSPC).
"""

import errno
import os
import signal
import sys

from trl_ppo import reporting, saving
from trl_ppo.cli import main
from trl_ppo.trainer import PPOTrainer

output_dir, moment = sys.argv[1], sys.argv[2]


def sigterm_to_myself():
    os.kill(os.getpid(), signal.SIGTERM)


def wrap(module, name, before):
    original = getattr(module, name)

    def wrapped(*args, **kwargs):
        before(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(module, name, wrapped)


def disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


if moment == "last_update":
    original_score = PPOTrainer.score

    def score(self, rollout, batch):
        if self.state.global_step + 1 == self.args.num_total_batches:
            sigterm_to_myself()
        return original_score(self, rollout, batch)

    PPOTrainer.score = score
elif moment == "curves":
    wrap(reporting, "plot_curves", lambda *args, **kwargs: sigterm_to_myself())
elif moment == "save":
    wrap(saving, "save_policy", lambda *args, **kwargs: sigterm_to_myself())
elif moment == "full_disk":
    wrap(reporting, "plot_curves", disk_full)
    wrap(saving, "write_model_card", disk_full)
main(["--output_dir", output_dir, "--total_episodes", "128", "--num_sample_generations", "0"])

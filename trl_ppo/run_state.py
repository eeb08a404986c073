"""`RunState`: everything of a PPO run that changes from update to update and must survive a resume.

`transformers.TrainerState` keeps the counters that `Trainer` and its callbacks read (`global_step`, the log
history; `episode` added by `PPOTrainerState`); everything PPO itself moves lives here, in one object that the
trainer creates in one place and that checkpoints save and restore whole (`state_dict` / `load_state_dict`,
written as `trl_ppo_state.json`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainerState

from .critic import CriticWatch
from .metrics import MetricsSinceLog
from .ppo import RunningMoments


@dataclass
class PPOTrainerState(TrainerState):
    """`TrainerState` with the number of episodes trained on so far (TRL's PPO trainers keep it there too, where
    callbacks read it). Saved in `trainer_state.json` with the other counters."""

    episode: int = 0


@dataclass
class RunState:
    """The mutable state of a PPO run besides the weights, the optimizer and `PPOTrainerState`."""

    kl_coef: float  # beta of this run's next update; moves under adaptive KL control (`kl_target`)
    score_moments: RunningMoments = field(default_factory=RunningMoments)  # of all scores, for score scaling
    data_position: tuple[int, int] = (0, 0)  # (epoch, batches already taken in it) of the shared data order
    metrics_since_log: MetricsSinceLog = field(default_factory=MetricsSinceLog)  # averaged at the next log
    policy_loss_sum: float = 0.0  # over all updates, for `TrainOutput.training_loss`
    skipped_updates: int = 0  # updates skipped for a non-finite loss (`skip_nonfinite_updates`)
    critic_watch: CriticWatch = field(default_factory=CriticWatch)  # a critic that explains nothing: warned once
    # Which run this is (`checkpoint.ownership.new_run_id`), kept through resumes: a checkpoint never replaces, or
    # is written beside, one of another run.
    run_id: str | None = None
    # (update, folder) of the newest checkpoint written or resumed from: not saved, it is where the state is.
    last_checkpoint: tuple[int, str] | None = None

    def state_dict(self) -> dict:
        """A JSON-ready copy (nothing in it is shared with this object)."""
        return {
            "kl_coef": self.kl_coef,
            "score_moments": self.score_moments.state_dict(),
            "data_position": list(self.data_position),
            "metrics_since_log": self.metrics_since_log.state_dict(),
            "policy_loss_sum": self.policy_loss_sum,
            "skipped_updates": self.skipped_updates,
            "critic_watch": self.critic_watch.state_dict(),
            "run_id": self.run_id,
        }

    def load_state_dict(self, state: dict) -> None:
        self.kl_coef = state["kl_coef"]
        self.score_moments.load_state_dict(state["score_moments"])
        self.data_position = tuple(state["data_position"])
        self.metrics_since_log.load_state_dict(state["metrics_since_log"])
        self.policy_loss_sum = state["policy_loss_sum"]
        self.skipped_updates = state["skipped_updates"]
        if "critic_watch" in state:  # checkpoints of an older trl_ppo have none: a fresh count
            self.critic_watch.load_state_dict(state["critic_watch"])
        self.run_id = state.get("run_id", self.run_id)  # checkpoints of an older trl_ppo have none

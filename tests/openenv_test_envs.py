"""OpenEnv environments for tests/test_openenv.py, served in server processes of their own (this folder is put on
their PYTHONPATH): the shipped ones, each keeping its own record of what it was sent (a JSON line per episode in
the file named by `OPENENV_RECORD`), the guessing game slowed by `delay` seconds a step when `reset` is given one."""

import json
import os
import time

from trl_ppo.agents.openenv_envs import ArithmeticEnvironment, GuessEnvironment


def record(kind: str, **fields) -> None:
    with open(os.environ["OPENENV_RECORD"], "a", encoding="utf-8") as file:
        file.write(json.dumps({"kind": kind, **fields}) + "\n")


class RecordedGuess(GuessEnvironment):
    """`GuessEnvironment`, its episodes recorded at their end (the target, the guesses, the rewards) or at `close`."""

    def reset(self, seed=None, episode_id=None, delay: float = 0.0, **kwargs):
        self.delay, self.rewards, self.spans, self.recorded = delay, [], [], False
        return super().reset(seed=seed, episode_id=episode_id, **kwargs)

    def step(self, action, timeout_s=None, **kwargs):
        start = time.time()
        time.sleep(self.delay)
        observation = super().step(action, timeout_s=timeout_s, **kwargs)
        self.rewards.append(observation.reward)
        self.spans.append((start, time.time()))
        return observation

    def close(self):
        if hasattr(self, "recorded") and not self.recorded:
            self.recorded = True
            record("guess", target=self.state.target, guesses=self.state.guesses, rewards=self.rewards,
                   spans=self.spans)
        super().close()


class RecordedArithmetic(ArithmeticEnvironment):
    """`ArithmeticEnvironment`, each tool call recorded with its arguments (and the problem) when it is made."""

    def _scored(self, observation):
        observation = super()._scored(observation)
        if not hasattr(observation, "tool_name"):  # the tools listed
            return observation
        record("call", problem=self.state.problem, tool=observation.tool_name, reward=observation.reward)
        return observation


class NoisyGuess(GuessEnvironment):
    """The guessing game writing 16 KiB to stderr at every reset, as a server that logs much does."""

    def reset(self, seed=None, episode_id=None, **kwargs):
        import sys

        sys.stderr.write("x" * 16384 + "\n")
        sys.stderr.flush()
        return super().reset(seed=seed, episode_id=episode_id, **kwargs)

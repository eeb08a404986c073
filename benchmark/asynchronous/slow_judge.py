"""The default job's reward behind a slow judge: the same scores after 0.5 s per batch (a judge model or an HTTP
call standing in), for `run.py`'s rows with a slow reward.

    trl-ppo --reward_function benchmark/asynchronous/slow_judge.py:slow_sentiment
"""

import time

from trl_ppo.default_job import sentiment_reward

JUDGE_SECONDS = 0.5


def slow_sentiment(prompts: list[str], completions: list[str], **columns) -> list[float]:
    time.sleep(JUDGE_SECONDS)
    return sentiment_reward(prompts, completions, **columns)

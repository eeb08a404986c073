"""The default job's reward behind a slow judge: the same scores after 0.5 s per batch (a judge model or an HTTP
call standing in), for `run.py`'s rows with a slow reward. `slow_sentiment` waits as a plain function does
(`time.sleep`: a blocking HTTP client); `async_slow_sentiment` as an `async` one (`asyncio.sleep`: an async HTTP
client, whose requests for several batches can be in flight at once).

    trl-ppo --reward_function benchmark/asynchronous/slow_judge.py:slow_sentiment
    trl-ppo --reward_function benchmark/asynchronous/slow_judge.py:async_slow_sentiment
"""

import asyncio
import time

from trl_ppo.default_job import sentiment_reward

JUDGE_SECONDS = 0.5


def slow_sentiment(prompts: list[str], completions: list[str], **columns) -> list[float]:
    time.sleep(JUDGE_SECONDS)
    return sentiment_reward(prompts, completions, **columns)


async def async_slow_sentiment(prompts: list[str], completions: list[str], **columns) -> list[float]:
    await asyncio.sleep(JUDGE_SECONDS)
    return sentiment_reward(prompts, completions, **columns)

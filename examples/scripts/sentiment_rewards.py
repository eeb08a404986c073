"""VADER's compound sentiment score as a trl_ppo reward function (the judge of the SmolLM2 sentiment examples).

VADER (Hutto and Gilbert 2014, `pip install vadersentiment`, or `pip install -e ".[real]"`) is a rule-based
analyser: its compound score is in [-1, 1], -1 very negative, +1 very positive. Used by

    trl-ppo train --config examples/configs/smollm2_sentiment.yaml     # --reward_function ...:vader_compound
    python examples/scripts/sentiment_legacy.py
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def analyzer():
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    return SentimentIntensityAnalyzer()


def vader_scores(texts: list[str]) -> list[float]:
    """VADER's compound score of each text, in [-1, 1]."""
    return [analyzer().polarity_scores(text)["compound"] for text in texts]


def vader_compound(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """The reward: how positive each completion (the review, without the prompt) reads, in [-1, 1]."""
    return vader_scores(completions)

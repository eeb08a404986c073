"""Chat prompts whose content is not text (issue 36): None, or a list of parts under a text-only template, were
rendered as "None" or as a Python list and trained on."""

import pytest

from trl_ppo.data import render_messages


@pytest.mark.parametrize(
    "content, message",
    [
        (None, r"message 1 \(role 'user'\) has no content \(None\); give its text as a string"),
        ([{"type": "text", "text": "the movie was"}], r"message 1 \(role 'user'\) holds a list of parts .*renders as "
         r"Python text.*join the parts' text into one string"),
        (42, r"message 1 \(role 'user'\) has content 42; give its text as a string"),
    ],
)
def test_chat_content_that_is_not_text_is_refused_naming_the_row(content, message, tokenizer):
    messages = [{"role": "system", "content": "be kind"}, {"role": "user", "content": content}]
    with pytest.raises(ValueError, match=rf"^Row 3 of `train_dataset`: {message}"):
        render_messages(messages, tokenizer, "train_dataset", 3)
    assert "user : the movie was" in render_messages(
        [{"role": "user", "content": "the movie was"}], tokenizer, "train_dataset", 3
    )

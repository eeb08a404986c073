"""`trl-ppo --reward_function` (issue 36): used by the embedded job too (it was silently ignored without
`--model_name_or_path`), a reward file that does not import names the flag, and model flags the embedded job
would ignore are refused."""

import re

import pytest
from test_cli import SMALL_RUN, refusal

from trl_ppo.cli import main


def test_the_embedded_job_scores_with_the_reward_function_it_is_given(tmp_path, capsys):
    reward_file = tmp_path / "mine.py"
    reward_file.write_text(
        "CALLS = []\n"
        "def shortness(prompts, completions, **_):\n"
        "    CALLS.append(len(completions))\n"
        "    return [-len(c) / 9 for c in completions]\n"
    )
    main(["--reward_function", f"{reward_file}:shortness", "--output_dir", str(tmp_path / "out"), *SMALL_RUN])
    assert "objective/scores/shortness" in capsys.readouterr().out


@pytest.mark.parametrize(
    "source, message",
    [
        ("def f(:\n    pass\n", r"importing .*bad\.py failed \(line 1\): SyntaxError: "),
        ("raise RuntimeError('no API key')\ndef f(p, c): return [0.0]\n", r"failed: RuntimeError: no API key\. Fix"),
    ],
)
def test_a_reward_file_that_does_not_import_names_the_flag(source, message, tmp_path):
    (tmp_path / "bad.py").write_text(source)
    text = refusal(["--reward_function", f"{tmp_path}/bad.py:f", "--output_dir", str(tmp_path / "out")])
    assert text.startswith(f"trl-ppo: --reward_function {tmp_path}/bad.py:f: ")
    assert re.search(message, text), text
    assert not (tmp_path / "out").exists()


def test_model_flags_without_model_name_or_path_are_refused(tmp_path):
    for flag in ("--reward_model_path", "--sft_model_path"):
        text = refusal([flag, str(tmp_path), "--output_dir", str(tmp_path / "out")])
        assert text.startswith(f"trl-ppo: {flag[2:] and flag} needs --model_name_or_path"), text


@pytest.mark.parametrize(
    "body, message",
    [
        ("return [float('nan')] * len(completions)", r"Reward 'scores' returned \d+ non-finite score\(s\)"),
        ("return [1.0]", r"Reward function 'scores' returned 1 scores: it must return a list"),
        ("return None", r"Reward function 'scores' returned NoneType None, not a list"),
    ],
)
def test_a_reward_returning_what_cannot_be_scores_is_one_line(body, message, tmp_path):
    """Found by benchmark/reliability/probe.py (issue 46, part 5): the message named the reward, after a traceback of
    trl_ppo's own frames; now `trl-ppo` shows the message alone."""
    from test_cli import SMALL_RUN

    (tmp_path / "mine.py").write_text(f"def scores(prompts, completions, **_):\n    {body}\n")
    argv = ["--reward_function", f"{tmp_path}/mine.py:scores", "--output_dir", str(tmp_path / "out"), *SMALL_RUN,
            "--num_sample_generations", "0"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    text = str(exit_.value.code)
    assert text.startswith("trl-ppo: Update 1: ") and re.search(message, text), text


def test_a_reward_function_that_raises_keeps_its_traceback(tmp_path):
    """A bug in the reward function is found in its traceback: not shortened to one line."""
    from test_cli import SMALL_RUN

    (tmp_path / "mine.py").write_text("def scores(prompts, completions, **_):\n    raise ValueError('my bug')\n")
    argv = ["--reward_function", f"{tmp_path}/mine.py:scores", "--output_dir", str(tmp_path / "out"), *SMALL_RUN,
            "--num_sample_generations", "0"]  # fmt: skip
    with pytest.raises(ValueError, match="Update 1: Reward function 'scores' raised: my bug"):
        main(argv)

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

"""The probe of what else can hang a run or lose what a user made (issue 46, part 5), kept from rotting: a handful of
its quickest cases, each with the outcome it had when docs/resuming.md's table was made, and its table. The probe
is `benchmark/reliability/probe.py`; its whole table is in docs/resuming.md ("What else was tried")."""

import os
import sys
import time

import pytest
from conftest import REPO_ROOT
from transformers import PreTrainedTokenizerBase

from trl_ppo.agents.chat import has_parsing_api

sys.path.insert(0, os.path.join(REPO_ROOT, "benchmark", "reliability"))

import probe  # noqa: E402

QUICK_CASES = {
    "reward_sys_exit": "stopped, named",  # ended the process silently with status 3 before
    "tool_hangs": "handled",  # never exited after saving its model before
    "env_reset_returns_int": "stopped, named",
    "output_dir_is_a_file": "stopped, named",
    "reward_prints_to_stdout": "handled",
}


@pytest.mark.slow
def test_the_quickest_cases_keep_their_outcomes(tmp_path):
    cases = {case.name: case for case in probe.CASES}
    # Tools need transformers' parsing API (5.24 on); `make test-oldest`'s 5.3 refuses them at construction.
    expected = {name: outcome for name, outcome in QUICK_CASES.items()
                if has_parsing_api(PreTrainedTokenizerBase) or cases[name].kind not in ("tool", "environment")}
    start = time.perf_counter()
    results = [probe.run_case(cases[name], tmp_path) for name in expected]
    outcomes = {result.case.name: (result.outcome, result.detail, result.last_line) for result in results}
    assert {name: outcome[0] for name, outcome in outcomes.items()} == expected, outcomes
    assert time.perf_counter() - start < 120  # about 30 s on 2 shared cores
    table = probe.table(results)
    named = sum(outcome == "stopped, named" for outcome in expected.values())
    assert f"| stopped, named | {named} |" in table and f"| total | {len(expected)} |" in table
    if "tool_hangs" in expected:
        assert "| tool_hangs | tool | handled |" in table


def test_the_last_line_skips_progress_bars_and_table_borders():
    text = "Traceback ...\nValueError: Update 1: bad\r  0%|          | 0/2 [00:00<?, ?it/s]\n└──────┘\n"
    assert probe.last_line(text) == "ValueError: Update 1: bad"


def test_every_case_has_a_unique_name_and_a_known_kind():
    names = [case.name for case in probe.CASES]
    assert len(names) == len(set(names)) >= 25
    assert {case.kind for case in probe.CASES} <= {"reward", "tool", "environment", "files", "signals"}


# User code that is no misbehaviour, under the default deadlines (benchmark/reliability/README.md, "User code as users
# write it"), with the outcome it has since issue 53.
USER_CODE_CASES = {
    "user_math_verify": "worked",  # stopped before: math_verify refused the worker thread the reward ran in
    "user_sqlite_cache": "worked",  # stopped before: an sqlite3 connection made at import is bound to its thread
    "tool_signal_alarm": "finished, not worked",  # documented: a sync tool runs in a thread, where signal cannot
}


@pytest.mark.slow
def test_user_code_keeps_its_outcomes(tmp_path):
    cases = {case.name: case for case in probe.CASES}
    expected = {name: outcome for name, outcome in USER_CODE_CASES.items()
                if has_parsing_api(PreTrainedTokenizerBase) or cases[name].kind != "tool"}
    results = [probe.run_case(cases[name], tmp_path) for name in expected]
    outcomes = {result.case.name: (result.outcome, result.detail, result.last_line) for result in results}
    assert {name: outcome[0] for name, outcome in outcomes.items()} == expected, outcomes
    assert f"| worked | {sum(outcome == 'worked' for outcome in expected.values())} |" in probe.table(results)

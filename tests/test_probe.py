"""The probe of what else can hang a run or lose what a user made (issue 46, part 5), kept from rotting: a handful of
its quickest cases, each with the outcome it had when docs/resuming.md's table was made, and its table. The probe
is `benchmark/reliability/probe.py`; its whole table is in docs/resuming.md ("What else was tried")."""

import os
import sys
import time

import pytest
from conftest import REPO_ROOT

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
    start = time.perf_counter()
    results = [probe.run_case(cases[name], tmp_path) for name in QUICK_CASES]
    outcomes = {result.case.name: (result.outcome, result.detail, result.last_line) for result in results}
    assert {name: outcome[0] for name, outcome in outcomes.items()} == QUICK_CASES, outcomes
    assert time.perf_counter() - start < 120  # about 30 s on 2 shared cores
    table = probe.table(results)
    assert "| tool_hangs | tool | handled |" in table and "| stopped, named | 3 |" in table
    assert "| total | 5 |" in table


def test_the_last_line_skips_progress_bars_and_table_borders():
    text = "Traceback ...\nValueError: Update 1: bad\r  0%|          | 0/2 [00:00<?, ?it/s]\n└──────┘\n"
    assert probe.last_line(text) == "ValueError: Update 1: bad"


def test_every_case_has_a_unique_name_and_a_known_kind():
    names = [case.name for case in probe.CASES]
    assert len(names) == len(set(names)) >= 25
    assert {case.kind for case in probe.CASES} <= {"reward", "tool", "environment", "files", "signals"}

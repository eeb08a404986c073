"""Result rows of the benchmark scripts: one JSON object per line (`json.dumps` with its defaults), printed and/or
appended to a JSON-lines file. The scripts live one folder down (`benchmark/<question>/x.py`) and put this folder on
`sys.path` before `from rows import ...`."""

from __future__ import annotations

import json
import os


def print_row(row: dict, **print_kwargs) -> None:
    """`row` as one JSON line on stdout (or `file=`), flushed: what a parent process or a log reads."""
    print(json.dumps(row), flush=True, **print_kwargs)


def append_row(path: str, row: dict) -> None:
    """Append `row` to the JSON-lines file `path` as one line, creating its folder if needed."""
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(row) + "\n")


def emit_row(row: dict, path: str | None = None) -> None:
    """`print_row(row)`, then `append_row(path, row)` when a results file is given."""
    print_row(row)
    if path:
        append_row(path, row)


def row_key(row: dict, fields) -> tuple:
    """The values of `fields` in `row` (a row, or a script's `vars(args)`), comparable across JSON round trips."""
    return tuple(json.dumps(row.get(name), sort_keys=True) for name in fields)


def has_row(path: str, row: dict, fields) -> bool:
    """Whether the JSON-lines file `path` (missing: no) holds a row equal to `row` on `fields`: a cell whose row is
    there is skipped, so a stopped sweep can be run again."""
    if not os.path.exists(path):
        return False
    key = row_key(row, fields)
    with open(path, encoding="utf-8") as lines:
        return any(row_key(json.loads(line), fields) == key for line in lines if line.strip())

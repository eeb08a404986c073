"""mkdocs hooks: the options reference rendered from the config fields' `help` metadata (the same text as
`trl-ppo --help-all`, in its sections), and `benchmark/RESULTS.md` with its plots published as `results.md`."""

from __future__ import annotations

import argparse
import os
import re

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIONS_MARK = "<!-- options -->"
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def results_files() -> list[str]:
    """`RESULTS.md` and every image it shows, read from its `![...](path)` links so a new plot is never left out."""
    with open(os.path.join(ROOT, "benchmark", "RESULTS.md"), encoding="utf-8") as handle:
        images = IMAGE.findall(handle.read())
    return ["RESULTS.md", *dict.fromkeys(path for path in images if "://" not in path)]


def on_files(files, config):
    """`benchmark/RESULTS.md` as the page `results.md`, its images at the same paths relative to it."""
    for name in results_files():
        uri = "results.md" if name == "RESULTS.md" else name
        files.append(File.generated(config, uri, abs_src_path=os.path.join(ROOT, "benchmark", *name.split("/"))))
    return files


def on_page_markdown(markdown, page, config, files):
    if OPTIONS_MARK in markdown:
        markdown = markdown.replace(OPTIONS_MARK, options_reference())
    return markdown


def cell(text) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def default_text(action: argparse.Action) -> str:
    if getattr(action, "hide_default", False) or action.default is argparse.SUPPRESS:
        return "see the text"
    return "" if action.default is None else f"`{cell(action.default)}`"


def options_reference() -> str:
    """One table per section of `trl-ppo --help-all`: flag, default and the field's whole help text."""
    from trl_ppo.cli import build_parser

    out = []
    for title, actions in build_parser().sections(full=True):
        if title == "general":
            continue
        rows = [a for a in actions if a.option_strings and not a.option_strings[0].startswith("--no_")]
        if not rows:
            continue
        out += [f"## {title[0].upper()}{title[1:]}", "", "| option | default | what it does |", "|---|---|---|"]
        out += [f"| `{a.dest}` | {default_text(a)} | {cell(a.help or '')} |" for a in rows]
        out.append("")
    return "\n".join(out)

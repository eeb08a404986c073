"""The README and the documentation site (issue 38): every code block marked `<!-- runs offline -->` runs as a
user would run it (a script of its own, in an empty folder), the README stays a five-minute read, the layout
table lists each module once, the options reference renders every option's own help, and the site builds with
`mkdocs build --strict`."""

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from trl_ppo.agents.chat import has_parsing_api

ROOT = Path(__file__).resolve().parent.parent
MARK = "<!-- runs offline -->\n```python\n"
HUB_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def offline_blocks() -> list[tuple[str, str]]:
    blocks = []
    for page in pages():
        for i, part in enumerate(page.read_text().split(MARK)[1:]):
            blocks.append((f"{page.relative_to(ROOT)}#{i}", part.split("```", 1)[0]))
    return blocks


def run_script(code: str, folder: Path) -> subprocess.CompletedProcess:
    script = folder / "example.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(script)], cwd=folder, env=env, capture_output=True, text=True)


def test_the_readme_and_the_agents_page_have_offline_examples():
    names = [name for name, _ in offline_blocks()]
    assert sum(name.startswith("README.md") for name in names) >= 3 and "docs/agents.md#0" in names


@pytest.mark.slow
@pytest.mark.parametrize("name, code", offline_blocks(), ids=[name for name, _ in offline_blocks()])
def test_every_offline_code_block_runs(name, code, tmp_path):
    if "tools=" in code and not has_parsing_api(PreTrainedTokenizerBase):  # `make test-oldest`: tools are refused
        pytest.skip("tools need transformers >= 5.24 (parse_response with prefix)")
    result = run_script(code, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    if name == "README.md#0":
        assert re.search(r"mean reward: 0\.\d\d at the first log, [1-9]\.\d\d at the last", result.stdout)
    if name == "docs/agents.md#0":
        assert "{'env/turns_mean': 1.0, 'env/tool_calls_mean': 0.0" in result.stdout
        assert (tmp_path / "agents-out").is_dir()


@pytest.mark.slow
def test_the_readmes_hub_example_runs_on_a_local_copy_of_its_model(smollm2_path, tmp_path):
    readme = (ROOT / "README.md").read_text()
    code = readme.split("## The same with a model from the hub", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert HUB_MODEL in code
    shrunk = {"total_episodes=64": "total_episodes=4", "per_device_train_batch_size=8": "per_device_train_batch_size=4"}
    assert all(text in code for text in shrunk)
    # one update of 4 episodes, not 8 updates of 8: the example's run is what is checked here, not its learning
    for text, smaller in shrunk.items():
        code = code.replace(text, smaller)
    result = run_script(code.replace(HUB_MODEL, smollm2_path), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "smollm2-ppo" / "config.json").is_file()


def test_the_readme_is_a_five_minute_read():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    assert "±" not in readme and "standard error" not in readme and "s.e." not in readme
    hashes = [word for word in re.findall(r"\b[0-9a-f]{7,40}\b", readme) if re.search(r"[a-f]", word)
              and re.search(r"\d", word)]
    assert not hashes, hashes
    assert readme.count("](benchmark/RESULTS.md") == 1  # linked once, under its summary table
    for target in re.findall(r"\]\(((?:docs|benchmark)/[^)#]+)", readme):
        assert (ROOT / target).is_file(), target


def test_the_layout_table_lists_each_module_once():
    design = (ROOT / "docs" / "reference" / "design.md").read_text()
    rows = [line for line in design.splitlines() if line.startswith("| `trl_ppo/")]
    for module in sorted((ROOT / "trl_ppo").glob("*.py")):
        if module.name in ("__init__.py", "__main__.py"):
            continue
        listed = [row for row in rows if f"`trl_ppo/{module.name}`" in row.split(" | ")[0]]
        assert len(listed) == 1, (module.name, len(listed))
    for package in ("agents", "checkpoint", "legacy", "rollout"):
        assert sum(row.startswith(f"| `trl_ppo/{package}/`") for row in rows) == 1, package


def load_hooks():
    pytest.importorskip("mkdocs")
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return hooks


def test_the_options_reference_renders_every_fields_own_help():
    from trl_ppo import PPOConfig

    text = load_hooks().options_reference()
    for field in dataclasses.fields(PPOConfig):
        if field.init and field.metadata.get("help"):
            assert f"| `{field.name}` |" in text, field.name
    kl = next(f for f in dataclasses.fields(PPOConfig) if f.name == "kl_coef")
    assert " ".join(kl.metadata["help"].split()).replace("|", "\\|") in text
    assert (ROOT / "docs" / "reference" / "options.md").read_text().count("| `kl_coef` |") == 0  # rendered, not copied


@pytest.mark.slow
def test_the_site_builds_strict_and_offline(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    options = (tmp_path / "site" / "reference" / "options" / "index.html").read_text()
    assert "response_length" in options and "kl_coef" in options
    assert (tmp_path / "site" / "results" / "index.html").is_file()

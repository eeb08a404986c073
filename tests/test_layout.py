"""The house: which module may import which (issue 54's circle `distributed` <-> `fsdp` <-> `models` is gone), and
the old module names of what moved into `trl_ppo.rollout` still import the same modules."""

import ast
import importlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "trl_ppo"


def imported_siblings(module: str) -> set[str]:
    """The top-level modules of `trl_ppo` that `trl_ppo/<module>.py` imports anywhere (lazy imports too)."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names |= {node.module} if node.module else {alias.name for alias in node.names}
    return {name.split(".")[0] for name in names}


def test_models_distributed_and_fsdp_import_each_other_one_way_only():
    assert "models" not in imported_siblings("distributed")
    assert "models" not in imported_siblings("fsdp")
    assert "distributed" not in imported_siblings("fsdp")


def test_the_old_names_of_moved_modules_are_the_moved_modules():
    import trl_ppo.rollout as rollout

    assert importlib.import_module("trl_ppo.generation") is importlib.import_module("trl_ppo.rollout.generation")
    assert importlib.import_module("trl_ppo.agents.turn_loop") is importlib.import_module("trl_ppo.rollout.turn_loop")
    from trl_ppo.models import decoder_blocks, freeze  # where they were
    from trl_ppo.modules import decoder_blocks as blocks, freeze as frozen

    assert (decoder_blocks, freeze) == (blocks, frozen)
    assert {"Rollout", "Sampling", "collect_rollout", "add_logprobs_and_values"} <= set(rollout.__all__)

"""Resuming refuses what would lose or repeat data (issue 36): another `data_seed`, an empty manifest, and a
checkpoint from before manifests whose weights file is truncated."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from trl_ppo.checkpoint.folders import PPO_STATE_NAME, checkpoint_to_resume, write_json
from trl_ppo.checkpoint.identity import identity_differences, run_identity
from trl_ppo.checkpoint.manifest import MANIFEST_NAME, checkpoint_problem, manifest_of


def test_resuming_with_another_data_seed_is_refused(make_config):
    """The saved position in the data order would point into another order: seen prompts drawn again."""
    saved = run_identity(make_config(data_seed=1), {})
    for now in (make_config(data_seed=2), make_config()):
        (difference,) = identity_differences(json.loads(json.dumps(saved)), run_identity(now, {}))
        assert difference.startswith(f"`data_seed`: 1 in the checkpoint, {now.data_seed!r} now (the saved position")
    assert identity_differences(saved, run_identity(make_config(data_seed=1), {})) == []


def test_an_empty_manifest_does_not_verify(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    write_json(str(tmp_path / MANIFEST_NAME), {**manifest_of(str(tmp_path)), "files": {}})
    assert checkpoint_problem(str(tmp_path)) == f"{tmp_path / MANIFEST_NAME} is damaged: it lists no files"


def test_a_checkpoint_from_before_manifests_with_truncated_weights_is_named_damaged(tmp_path):
    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    save_file({"weight": torch.zeros(64)}, str(folder / "model.safetensors"))
    write_json(str(folder / PPO_STATE_NAME), {"kl_coef": 0.05})  # no "manifest": an older trl_ppo's
    assert checkpoint_to_resume(str(tmp_path), str(folder)) == str(folder)
    with open(folder / "model.safetensors", "r+b") as handle:
        handle.truncate(os.path.getsize(folder / "model.safetensors") - 8)
    with pytest.raises(ValueError, match=r"is not a whole trl_ppo checkpoint: .*model\.safetensors cannot be read "
                                         r"\(SafetensorError: .*\): it is truncated or damaged"):
        checkpoint_to_resume(str(tmp_path), str(folder))


def test_trl_ppo_shows_a_refused_resume_without_a_traceback(tmp_path):
    """Found by benchmark/reliability/probe.py (issue 46, part 5): `trl-ppo --resume_from_checkpoint latest` with
    another seed listed the difference after a traceback of trl_ppo's frames; now the message alone."""
    from test_cli import SMALL_RUN

    from trl_ppo.cli import main

    run = ["--output_dir", str(tmp_path / "out"), *SMALL_RUN, "--num_sample_generations", "0", "--save_strategy",
           "steps", "--save_steps", "1"]  # fmt: skip
    main(run)
    with pytest.raises(SystemExit) as exit_:
        main([*run, "--seed", "9", "--resume_from_checkpoint", "latest"])
    message = str(exit_.value.code)
    assert message.startswith("trl-ppo: Cannot resume from ") and "written by a different run" in message, message
    assert "`seed`: checkpoint has 1, this run has 9" in message, message

"""The final save is whole or not at all (issue 36): a full disk during `save_model` (core, with a value head or a
separate value model) or legacy `save_pretrained` leaves no config.json without weights, keeps an earlier model
in the folder, and raises `ModelSaveError` naming the folder and the space needed; `save_model` into an
existing file is refused naming `output_dir`."""

import os

import pytest
import safetensors.torch
import transformers.modeling_utils
from conftest import build_trainer
from safetensors import SafetensorError
from test_legacy import _one_thread, _run_in_tmp_path, config_for, gpt2_path, load_vhead  # noqa: F401

from trl_ppo.saving import ModelSaveError


def files_of(folder) -> dict:
    found = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            found[os.path.relpath(path, folder)] = open(path, "rb").read()
    return found


def full_disk_at_write(monkeypatch, which: int):
    """The `which`-th safetensors file written (1: the first) is cut short and its writer raises, as safetensors
    does when the disk fills."""
    calls = []
    real = safetensors.torch.save_file

    def save_file(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == which:
            real(tensors, filename, metadata=metadata)
            with open(filename, "r+b") as handle:
                handle.truncate(os.path.getsize(filename) // 2)
            raise SafetensorError("Error while serializing: IoError(File too large)")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", save_file)
    return calls


@pytest.mark.parametrize("value_model, failing_write", [(None, 2), ("separate", 2), ("separate", 1)])
def test_a_full_disk_during_save_model_leaves_the_earlier_model_whole(
    value_model, failing_write, make_config, tokenizer, load_models, monkeypatch, tmp_path
):
    """A value head: the policy's weights, then value_head.safetensors; a separate value model
    (`save_value_model=True`): the policy's, then value_model/model.safetensors."""
    config = make_config(save_value_model=value_model == "separate")
    trainer = build_trainer(config, tokenizer, load_models, value_model=value_model)
    output_dir = str(tmp_path / "model")
    trainer.save_model(output_dir)
    earlier = files_of(output_dir)
    assert "config.json" in earlier
    full_disk_at_write(monkeypatch, failing_write)
    with pytest.raises(ModelSaveError, match=rf"Saving the model to {output_dir} failed \(SafetensorError: .*File "
                       r"too large\)\)\. Nothing of this save was left .* needs about [\d.]+ MiB; [\d.]+ MiB are free"):
        trainer.save_model(output_dir)
    assert files_of(output_dir) == earlier

    fresh = str(tmp_path / "fresh")
    full_disk_at_write(monkeypatch, failing_write)
    with pytest.raises(ModelSaveError, match="Nothing of this save was left"):
        trainer.save_model(fresh)
    assert not os.path.exists(fresh)  # not a config.json without weights


def test_a_full_disk_during_legacy_save_pretrained_leaves_nothing(gpt2_path, tokenizer, monkeypatch, tmp_path):
    from trl_ppo.legacy import PPOTrainer

    trainer = PPOTrainer(config_for(), load_vhead(gpt2_path), None, tokenizer)
    target = tmp_path / "saved"
    full_disk_at_write(monkeypatch, 1)
    with pytest.raises(ModelSaveError, match=rf"Saving the model to {target} failed \(SafetensorError"):
        trainer.save_pretrained(str(target))
    assert not target.exists()
    monkeypatch.undo()
    trainer.save_pretrained(str(target))
    assert {"config.json", "model.safetensors"} <= set(os.listdir(target))
    assert not [name for name in os.listdir(target) if name.startswith(".tmp")]


def test_save_model_into_an_existing_file_names_output_dir(make_config, tokenizer, load_models, tmp_path):
    trainer = build_trainer(make_config(), tokenizer, load_models)
    target = tmp_path / "model.bin"
    target.write_bytes(b"mine")
    with pytest.raises(NotADirectoryError, match=r"`output_dir` .*model\.bin.* existing file.*Pass the path of a fol"):
        trainer.save_model(str(target))
    assert target.read_bytes() == b"mine"

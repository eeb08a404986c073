"""What the checkpoint manifest costs: the time to hash a checkpoint (at save) and to verify it (at resume),
against the time to write the same bytes, on files shaped like a model's checkpoint.

    python benchmark/reliability/checkpoint_manifest.py --gib 2 --dir /tmp/manifest_bench

It writes a policy-like safetensors file (1/4 of the bytes), an optimizer-like torch file (1/2) and a value
model (1/4) with `torch.save` / safetensors, as a checkpoint's writer does, then times writing the manifest and
`checkpoint_problem` on them (the files are in the page cache then, as they are right after a save). Prints one
JSON line.
"""

import argparse
import os
import shutil
import sys
import time

import torch
from safetensors.torch import save_file

from trl_ppo.checkpoint.folders import write_json
from trl_ppo.checkpoint.manifest import MANIFEST_NAME, checkpoint_problem, manifest_of

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmark/: rows.py
from rows import print_row  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="total size of the checkpoint's files, GiB")
    parser.add_argument("--dir", default="/tmp/trl_ppo_manifest_bench", help="scratch folder (removed after)")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(os.path.join(args.dir, "value_model"))
    floats = int(args.gib * 2**30 / 4)
    start = time.perf_counter()
    save_file({"w": torch.randn(floats // 4)}, os.path.join(args.dir, "model.safetensors"))
    torch.save({"state": torch.randn(floats // 2)}, os.path.join(args.dir, "optimizer.pt"))
    save_file({"w": torch.randn(floats // 4)}, os.path.join(args.dir, "value_model", "model.safetensors"))
    os.sync()
    write_s = time.perf_counter() - start
    start = time.perf_counter()
    write_json(os.path.join(args.dir, MANIFEST_NAME), manifest_of(args.dir))
    manifest_s = time.perf_counter() - start
    start = time.perf_counter()
    assert checkpoint_problem(args.dir) is None
    verify_s = time.perf_counter() - start
    shutil.rmtree(args.dir)
    result = dict(gib=args.gib, write_and_sync_s=round(write_s, 2), manifest_s=round(manifest_s, 2))
    result.update(verify_s=round(verify_s, 2), hash_gib_per_s=round(args.gib / manifest_s, 2), cpus=os.cpu_count())
    print_row(result)


if __name__ == "__main__":
    main()

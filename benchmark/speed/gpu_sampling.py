"""Sampling alone: milliseconds per decoding step of each trl_ppo generation backend, as a rollout samples.

    python benchmark/speed/gpu_sampling.py --shape 1b --precision bf16 --batch 64    # GPU: every backend
    python benchmark/speed/gpu_sampling.py --shape tiny --backends kv_cache generate --warmup 1 --repeats 2  # CPU

The policy is bench_ppo.py's random GPT-NeoX of the pythia shape (same seed), the prompts its 32-64 random tokens
left-padded by trl_ppo's collator; 53 tokens, no stop token, temperature 0.7. Each backend is called as a rollout
calls it: eval mode, float32 weights under bf16 autocast (a bf16 run keeps the policy in float32). `--warmup` calls
(compilation, CUDA-graph capture) are not timed; each of the `--repeats` calls is timed between two synchronizes.
One JSON line per backend: median and best seconds per call, ms per decoding step (median / response_length, all
`--batch` rows at once), appended to `--results` if given. 'compiled' is what 'auto' means on CUDA.
"""

import argparse
import os
import statistics
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # bench_ppo.py here, rows.py in benchmark/
import bench_ppo  # noqa: E402
from rows import emit_row  # noqa: E402

from trl_ppo.data import LeftPaddingCollator, prompts_on_device  # noqa: E402
from trl_ppo.default_job import build_word_tokenizer  # noqa: E402
from trl_ppo.rollout.generation import generation_backend  # noqa: E402

BACKENDS = ("kv_cache", "compiled", "compiled_loop", "generate")  # baseline first, then the CUDA default


def time_backend(name: str, policy, queries, query_mask, pad_token_id: int, cli) -> dict:
    sample, settings = generation_backend(name, {}, cli.response_length, 0.7, None)
    on_gpu = queries.device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    times = []
    torch.manual_seed(0)
    with torch.autocast(queries.device.type, dtype=torch.bfloat16, enabled=cli.precision == "bf16"):
        for _ in range(cli.warmup + cli.repeats):
            sync()
            start = time.perf_counter()
            responses = sample(policy, queries, query_mask, pad_token_id=pad_token_id, **settings)
            sync()
            times.append(time.perf_counter() - start)
    assert responses.shape == (queries.size(0), cli.response_length), responses.shape
    seconds = times[cli.warmup :]
    median = statistics.median(seconds)
    return {
        "backend": name,
        "shape": cli.shape,
        "precision": cli.precision,
        "batch": queries.size(0),
        "response_length": cli.response_length,
        "device": torch.cuda.get_device_name() if on_gpu else bench_ppo.cpu_name(),
        "first_call_seconds": round(times[0], 3),
        "seconds_per_call": round(median, 4),
        "best_seconds_per_call": round(min(seconds), 4),
        "ms_per_token": round(1000 * median / cli.response_length, 3),
        "tokens_per_second": round(queries.size(0) * cli.response_length / median, 1),
        "warmup_repeats": [cli.warmup, cli.repeats],
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(bench_ppo.SHAPES), default="1b")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--batch", type=int, default=64, help="Prompts per sampling call.")
    parser.add_argument("--response_length", type=int, default=53)
    parser.add_argument("--warmup", type=int, default=3, help="Untimed calls per backend (compilation, capture).")
    parser.add_argument("--repeats", type=int, default=5, help="Timed calls per backend; the median is reported.")
    parser.add_argument("--results", default=None, help="JSON lines appended here.")
    cli = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = build_word_tokenizer()
    # The value and reward models are built (and dropped) too, so that the policy gets bench_ppo.py's draws.
    policy = bench_ppo.build_models(cli.shape, tokenizer, 0)[0].eval()
    prompts = bench_ppo.random_prompts(bench_ppo.SHAPES[cli.shape][3], cli.batch, seed=0)
    batch = LeftPaddingCollator(tokenizer.pad_token_id)(list(prompts))
    queries, query_mask = prompts_on_device(batch, device, tokenizer.pad_token_id)
    for name in cli.backends:
        try:
            row = time_backend(name, policy, queries, query_mask, tokenizer.pad_token_id, cli)
        except Exception:  # one backend failing should not hide the others' timings
            print(f"[{name}] failed:\n{traceback.format_exc()[-3000:]}", file=sys.stderr, flush=True)
            continue
        emit_row(row, cli.results)


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# The GPU rows of benchmark/RESULTS.md in one command, on the machine that the `device` tool lends:
#   here, once:    bash benchmark/speed/fetch_wheels.sh                              (-> .whl/)
#   device tool:   run(command="bash benchmark/speed/run_gpu.sh", carry=[".whl"])    (about 6 minutes on an H100)
# Default rows: shapes 160m and 1b, fp32 and bf16, trl_ppo and TRL 1.12 alternated, 3 measured updates each, trl_ppo
# with the whole minibatch per training pass. Arguments are appended to bench_ppo.py's and override these, e.g.
#   bash benchmark/speed/run_gpu.sh --shape 410m --precision bf16
#   bash benchmark/speed/run_gpu.sh --shape 1b --precision bf16 --trainers trl_ppo \
#       --trl_ppo_flags "train_forward_batch_size=64 gradient_checkpointing=true"
# Rows are appended to benchmark/speed/results_h100.jsonl and the plot redrawn; both are copied to $OUT when it is set.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c "import torch, transformers, accelerate; print(torch.__version__, transformers.__version__, accelerate.__version__)"
python3 benchmark/speed/bench_ppo.py --shape 160m 1b --precision fp32 bf16 --updates 3 \
    --trl_ppo_flags train_forward_batch_size=64 --results benchmark/speed/results_h100.jsonl "$@"
python3 benchmark/speed/plot_results.py benchmark/speed/results_h100.jsonl benchmark/speed/results_cpu.jsonl -o benchmark/speed/results.png
if [ -n "${OUT:-}" ]; then cp benchmark/speed/results_h100.jsonl benchmark/speed/results.png "$OUT"/; fi

#!/usr/bin/env bash
# Calibration (or the table): every task x method for the seeds given, one run at a time, rows appended to $OUT;
# rows already there are skipped (run.py), so a stopped sweep resumes. Usage: benchmark/credit/sweep.sh OUT SEED...
set -euo pipefail
OUT=$1; shift
HERE=$(dirname "$0")
METHODS=("grpo" "gae --gae_level turn" "gae --gae_level token" "rloo" "reinforce_baseline")
for method in "${METHODS[@]}"; do
  for task in random_start key_to_door chain_2 chain_4 chain_8; do
    for seed in "$@"; do
      # shellcheck disable=SC2086  # $method holds the estimator and its flags
      OMP_NUM_THREADS=1 python "$HERE/run.py" --task "$task" --estimator $method --seed "$seed" --out "$OUT"
    done
  done
done

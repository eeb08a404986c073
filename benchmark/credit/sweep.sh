#!/usr/bin/env bash
# Every task x method for the seeds given, one run at a time, rows appended to $OUT; rows already there are skipped
# (run.py), so a stopped sweep resumes. Usage: [LR=1e-3] [METHOD="gae --gae_level turn"] sweep.sh OUT SEED...
set -euo pipefail
OUT=$1; shift
HERE=$(dirname "$0")
LR=${LR:-1e-3}
if [[ -n "${METHOD:-}" ]]; then METHODS=("$METHOD"); else
  METHODS=("grpo" "gae --gae_level turn" "gae --gae_level token" "rloo" "reinforce_baseline"); fi
for method in "${METHODS[@]}"; do
  for task in random_start key_to_door chain_2 chain_4 chain_8; do
    for seed in "$@"; do
      # shellcheck disable=SC2086  # $method holds the estimator and its flags
      OMP_NUM_THREADS=1 python "$HERE/run.py" --task "$task" --estimator $method --seed "$seed" --lr "$LR" --out "$OUT"
    done
  done
done

#!/usr/bin/env bash
# The table (issue 42, part 3): a learning-rate sweep (3e-4, 1e-3, 3e-3) of every method on seed 0, then seeds 1-4
# at each method's best rate on seed 0 (report.py --best_lr). Two processes at a time (one per core), each one run
# after another; rows already in $OUT are skipped, so a stopped table resumes. Usage: table.sh OUT
set -euo pipefail
OUT=$1
HERE=$(dirname "$0")
LR=3e-4 "$HERE/sweep.sh" "$OUT" 0 & LR=3e-3 "$HERE/sweep.sh" "$OUT.b" 0 & wait
LR=1e-3 "$HERE/sweep.sh" "$OUT" 0
cat "$OUT.b" >> "$OUT" && rm "$OUT.b"
for method in "grpo" "gae --gae_level turn" "gae --gae_level token" "rloo" "reinforce_baseline"; do
  lr=$(python "$HERE/report.py" "$OUT" --best_lr "$method")
  LR=$lr METHOD=$method "$HERE/sweep.sh" "$OUT" 1 2 & LR=$lr METHOD=$method "$HERE/sweep.sh" "$OUT.b" 3 4 & wait
  cat "$OUT.b" >> "$OUT" && rm "$OUT.b"
done

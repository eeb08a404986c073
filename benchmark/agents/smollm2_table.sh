#!/usr/bin/env bash
# Issue 43's comparison: PPO (turn-level GAE), GRPO, RLOO and TRL's GRPO from the same SmolLM2 warm start, seeds
# 0-2, 16 updates of 8 episodes at lr 3e-5 (smollm2_tool.py's other defaults). Two queues side by side, one per core
# (OMP_NUM_THREADS=1); a row already in OUT is skipped and a stopped cell resumes from its checkpoint (every 4
# updates), so the table can be run again across sessions. About 35 CPU-minutes a cell, evaluation included.
# Usage: [PYTHON=.venv/bin/python] smollm2_table.sh [OUT]   (OUT: smollm2_tool.jsonl beside this script)
set -euo pipefail
HERE=$(dirname "$0")
OUT=${1:-$HERE/smollm2_tool.jsonl}
cell() { OMP_NUM_THREADS=1 "${PYTHON:-python}" "$HERE/smollm2_tool.py" --learning_rate 3e-5 --updates 16 \
           --save_steps 4 --out "$OUT" --estimator "$@"; }
queue() { for args in "$@"; do cell $args; done; }
# Seed-major order: a session that stops early leaves every method with its lower seeds done.
queue "gae --seed 0" "rloo --seed 0" "grpo --seed 1" "trl_grpo --seed 1" "gae --seed 1" "rloo --seed 2" "gae --seed 2" &
queue "grpo --seed 0" "trl_grpo --seed 0" "rloo --seed 1" "grpo --seed 2" "trl_grpo --seed 2" &
wait

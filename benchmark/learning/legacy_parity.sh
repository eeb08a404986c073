#!/usr/bin/env bash
# Learning parity of trl_ppo.legacy against TRL 0.11.4 (see benchmark/learning/legacy_parity.py for what is measured).
#
#   bash benchmark/learning/legacy_parity.sh              seeds 0 1 2 under each library, then the markdown table
#   SEEDS="$(seq -s ' ' 0 19)" bash benchmark/learning/legacy_parity.sh
#   The seeds' spread is large (sd of the gain ~0.18), so 3 seeds tell apart only gross differences (standard error
#   of the difference ~0.15); 20 seeds bring it to ~0.06. A run takes ~5 s on an idle 2-core machine.
#   OUT_DIR=outputs/legacy_parity  (default; git-ignored) holds one JSON per run and the run logs.
#
# TRL 0.11.4 needs transformers 4.x and trl_ppo transformers >= 5, so the two run in two virtual environments:
#   .venv-trl011  made here (git-ignored): torch first, pinned (the CPU wheel served locally: an unpinned torch
#                 would pull the multi-GB CUDA build), then TRL 0.11.4 with the releases of its time;
#   .venv         the project's own (`make install`), with trl_ppo installed editable.
# The runs go one after the other, never two at once: on 2 cores two trainings slow each other ten-fold.
set -euo pipefail
cd "$(dirname "$0")/../.."

SEEDS="${SEEDS:-0 1 2}"
OUT_DIR="${OUT_DIR:-outputs/legacy_parity}"
TRL_VENV=.venv-trl011
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
TRL011_SPECS=(
    "trl==0.11.4" "transformers==4.46.3" "accelerate==1.1.1" "datasets==3.1.0" "tokenizers==0.20.3"
    "numpy==1.26.4" "pyarrow==18.1.0" "rich"  # TRL 0.11.4 imports rich without declaring it
)

if [ ! -f "$TRL_VENV/.installed" ]; then
    test -x "$TRL_VENV/bin/python" || python3 -m venv "$TRL_VENV"
    "$TRL_VENV/bin/python" -m pip install --quiet --upgrade pip
    "$TRL_VENV/bin/python" -m pip install --quiet "$TORCH_SPEC"
    "$TRL_VENV/bin/python" -m pip install --quiet "${TRL011_SPECS[@]}"
    touch "$TRL_VENV/.installed"
fi
make --quiet install  # the project's .venv, if it is not there yet

mkdir -p "$OUT_DIR"
rm -f "$OUT_DIR"/*.json
status=0
for library in trl trl_ppo; do
    if [ "$library" = trl ]; then python="$TRL_VENV/bin/python"; else python=.venv/bin/python; fi
    for seed in $SEEDS; do
        log="$OUT_DIR/${library}_seed${seed}.log"
        if "$python" benchmark/learning/legacy_parity.py --library "$library" --seed "$seed" \
            --out "$OUT_DIR/${library}_seed${seed}.json" > "$log" 2>&1; then
            tail -n 1 "$log"
        else
            echo "FAILED: $python benchmark/learning/legacy_parity.py --library $library --seed $seed (log: $log)"
            tail -n 20 "$log"
            status=1
        fi
    done
done

echo
.venv/bin/python benchmark/learning/legacy_parity.py --report "$OUT_DIR"
exit $status

#!/usr/bin/env bash
# Download, on a machine with PyPI, the wheels that `benchmark/speed/run_gpu.sh` installs on the GPU machine lent by the
# `device` tool (it has torch, transformers, accelerate and peft, but no network): TRL 1.12 and what it needs that
# the GPU image lacks, built for its Python 3.12 on x86-64; DeepSpeed's source distribution with the pure-Python
# dependencies the image lacks (gpu_check.sh's "sharded" step installs it with DS_BUILD_OPS=0); gguf and vaderSentiment
# (its "real" step). They land in .whl/ (git-ignored; ~7 MB). transformers 5.24 and regex (its "agents" step: the tool
# path needs 5.24, the image has 5.17) land in .gpu_c/ (git-ignored; ~14 MB), which travels in a call of its own.
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS="${WHEELS_DIR:-.whl}"
mkdir -p "$WHEELS"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$WHEELS" trl==1.12.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 hjson==3.1.0 pydantic==2.14.4 \
    pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 gguf==0.19.0 \
    vadersentiment==3.3.2
python3 -m pip download --quiet --no-deps --no-binary=:all: -d "$WHEELS" deepspeed==0.19.8
AGENT_WHEELS="${AGENT_WHEELS_DIR:-.gpu_c}"
mkdir -p "$AGENT_WHEELS"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$AGENT_WHEELS" transformers==5.24.0 regex==2026.11.19
ls "$WHEELS" "$AGENT_WHEELS"

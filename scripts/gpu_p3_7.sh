#!/usr/bin/env bash
# Phase 3.7's figures still owed by a GPU, in parts that each fit a 10-minute run on a borrowed machine.
#
#   bash scripts/gpu_p3_7.sh kernel     gpu-tier tests of the merge, graph-replay timing and the tuned kernel;
#                                       graph_bench's kernel table (GPU time by graph replay, GB/s, % of HBM)
#   bash scripts/gpu_p3_7.sh step       graph_bench's step and host sections: ms/step and wall / GPU per batch,
#                                       static, graph, overlapped; the host's own share (target: <= 1.3x GPU)
#   bash scripts/gpu_p3_7.sh workload   graph_workload, graphs and overlap against HF compiled (targets 1.5x, 3x)
#   bash scripts/gpu_p3_7.sh tune       the launch-config and split sweep (tuning.py, 36 configs), for
#                                       DEFAULT_CONFIG and split_rule.py's constants
#   bash scripts/gpu_p3_7.sh tier       the whole gpu test tier (pytest -m gpu)
#   bash scripts/gpu_p3_7.sh fused      phase 3.8: its gpu tests, then fused_bench (kernels per step; ms/step and
#                                       the graph's GPU time, phase 3.7's graph against the fused one)
#   bash scripts/gpu_p3_7.sh fused_workload   phase 3.8: fused_workload, the fused engines against HF compiled
#
# With a 30-minute GPU budget (three parts at most), the order that answers the most: `fused` (phase 3.7's graph
# against the fused and the fused overlapped graph, ms/step and GPU time: are the fused kernels faster, is the
# host hidden), then `fused_workload` (the equal and mixed targets against HF compiled), then `kernel` (the
# decode kernel's share of HBM by graph replay). `step`, `workload`, `tune` and `tier` after those.
#
# Reports go to $OUT (default /tmp/gpu_p3_7), each part's output to $OUT/<part>.log; copy the reports into
# results/ and quote them in the phase README. Model: dummy:qwen3-0.6b (random weights, nothing to download).
# A wheel directory .whl/ (e.g. transformers==5.23.0, the version the repo pins, fetched elsewhere with
# `pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl transformers==5.23.0`) is
# installed into a scratch folder first, for machines whose image has other versions and no network.
# Such a machine's torch and triton stay its own (the H100 of phase 3.7's figures: torch 2.11, triton 3.6.0);
# `bash scripts/device_versions_check.sh` runs the CPU suite and the sm_90 compiles under those first.
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:?"which part: kernel, step, workload, tune, tier, fused or fused_workload"}
OUT=${OUT:-/tmp/gpu_p3_7}
PY=${PY:-python3}
MODEL=${MODEL:-dummy:qwen3-0.6b}
LIMIT_S=${LIMIT_S:-560}          # the whole part, so it ends (and its files come back) before a 600 s limit
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
START=$SECONDS

if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/gpu_p3_7_site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/gpu_p3_7_site${PYTHONPATH:+:$PYTHONPATH}
fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
            'transformers', transformers.__version__)"
    git log --oneline -1 2>/dev/null || true
} 2>&1 | tee "$OUT/env.log"

left() { echo $((LIMIT_S - (SECONDS - START))); }
step() {   # step NAME CMD...: CMD under what is left of the part's time, its output in $OUT/NAME.log
    local name=$1; shift
    local limit; limit=$(left)
    if [ "$limit" -lt 30 ]; then echo "=== $name skipped: ${limit}s left" | tee "$OUT/$name.log"; return; fi
    echo "=== $name (limit ${limit}s, at $((SECONDS - START))s)"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - START))s" | tee -a "$OUT/$name.log"
}
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o addopts= --durations=10)

case $PART in
    kernel)
        step kernel_tests "${PYTEST[@]}" tests/gpu/test_merge_kernel_gpu.py tests/gpu/test_kernel_bench_gpu.py \
            "tests/gpu/test_engine_p3_7_gpu.py::test_tuned_kernel_compiled_equals_reference"
        step graph_bench_kernel $PY -m common graph_bench --device cuda --model "$MODEL" --sections kernel \
            --results-dir "$OUT" ;;
    step)
        step graph_bench_step $PY -m common graph_bench --device cuda --model "$MODEL" --sections step host \
            --results-dir "$OUT" ;;
    workload)
        step graph_workload $PY -m common graph_workload --device cuda --model "$MODEL" \
            --engines graphs overlap hf_compiled --results-dir "$OUT" ;;
    tune)
        step tuning $PY -m phases.p3_7_cuda_graphs.tuning --out "$OUT" ;;
    tier)
        step tier "${PYTEST[@]}" -m gpu tests/gpu ;;
    fused)
        step fused_tests "${PYTEST[@]}" tests/gpu/test_engine_p3_8_gpu.py
        step fused_bench $PY -m common fused_bench --device cuda --model "$MODEL" --results-dir "$OUT" ;;
    fused_workload)
        step fused_workload $PY -m common fused_workload --device cuda --model "$MODEL" \
            --engines fused fused_overlap hf_compiled --results-dir "$OUT" ;;
    *)
        echo "unknown part '$PART': kernel, step, workload, tune, tier, fused or fused_workload" >&2; exit 2 ;;
esac
ls -la "$OUT"

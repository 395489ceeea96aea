#!/usr/bin/env bash
# Issue 27's GPU checks in one run, from the repository root, results under $OUT:
#   gpu_check.log   everything printed, part by part
#   results.json    bench/bench_gpu.py's results, keyed by part
# Parts, most important first, each under `timeout` within one overall budget (TOTAL_S):
# fused attention self-check; CUDA tests; 1-stage 1 B bf16 throughput against eager PyTorch;
# 2 stages sharing the GPU; bf16 vs fp32 loss curves of a 2-stage run; check-ops on CUDA.
#
#   OUT=/some/dir bash bench/gpu_check.sh                    # on the GPU machine
#   GPU_CHECK_TINY=1 OUT=/tmp/out bash bench/gpu_check.sh    # tiny sizes on this CPU (a dry run)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/h2-gpu-check}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
JSON=$OUT/results.json
: > "$LOG"
rm -f "$JSON"
TOTAL_S=${TOTAL_S:-420}
T0=$(date +%s)

if [ "${GPU_CHECK_TINY:-0}" = 1 ]; then
    PY=${PY:-.venv/bin/python}
    DEV=cpu
    SIZE=(--tiny)
    export PYTHONPATH=$PWD
else
    PY=${PY:-python3}
    DEV=cuda
    SIZE=()
    # the device has torch; h2's other dependencies travel as wheels (.whl/)
    if ls .whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl 2>&1 | tail -3
    fi
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
WORK=$(mktemp -d /tmp/h2-gpu-check-XXXXXX)

say() { echo "$*" | tee -a "$LOG"; }

# part NAME BUDGET_S COMMAND...: runs under what is left of TOTAL_S (skipped under 20 s)
part() {
    local name=$1 budget=$2
    shift 2
    local left=$(( TOTAL_S - ($(date +%s) - T0) ))
    [ "$budget" -gt "$left" ] && budget=$left
    if [ "$budget" -lt 20 ]; then
        say "=== $name: SKIPPED (${left}s of the ${TOTAL_S}s budget left)"
        return
    fi
    say "=== $name (budget ${budget}s, t=$(( $(date +%s) - T0 ))s)"
    local s=$(date +%s)
    timeout -k 10 "$budget" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    say "=== $name: rc=$rc$([ "$rc" = 124 ] && echo ' (TIMED OUT)') in $(( $(date +%s) - s ))s"
}

say "h2 gpu_check: $(git rev-parse --short HEAD 2>/dev/null || echo '?') on $(hostname), $(date -u +%FT%TZ)"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.max.sm \
        --format=csv 2>&1 | tee -a "$LOG"
fi
"$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, 'available', torch.cuda.is_available(),
torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" 2>&1 | tee -a "$LOG"

B=(bench/bench_gpu.py --device "$DEV" "${SIZE[@]}" --json "$JSON")
part attention-check 60 "$PY" "${B[@]}" --part attn
part tests 60 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda_path.py -k "not smoke"
part perf-1stage 150 "$PY" "${B[@]}" --part perf --stages 1 --rounds 2 --workdir "$WORK/p1"
rm -rf "$WORK/p1"
part perf-2stage 110 "$PY" "${B[@]}" --part perf --stages 2 --rounds 1 --workdir "$WORK/p2"
rm -rf "$WORK/p2"
part loss-curve 90 "$PY" "${B[@]}" --part curve --workdir "$WORK/c"
part check-ops-cuda 40 "$PY" -m frontend.cli check-ops --backend torch --device "$DEV" --dtype bf16
rm -rf "$WORK"
say "=== done in $(( $(date +%s) - T0 ))s; results in $JSON"

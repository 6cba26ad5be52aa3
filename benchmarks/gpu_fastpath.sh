#!/usr/bin/env bash
# The small-batch decode path on one GPU: the fused norm + projection (+ SiLU) kernels beside
# the separate kernels (--no-fused-decode) in the same run, end to end (Llama-3-8B batch 1 and
# 64 at 1k context, SmolLM2-135M batch 1), after the GPU correctness check; then the kernel
# checks and timings of benchmarks/gpu_fastpath.py. Results go to $OUT (default
# benchmarks/results).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export SPLITSERVE_GIT_COMMIT=${SPLITSERVE_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-benchmarks/results}
PY=${PY:-python3}
mkdir -p "$OUT"
status=0
step() { echo "== $*"; "$@" || { echo "!! failed: $*"; status=1; }; }
bench() { step "$PY" -m splitserve.cli bench offline --device cuda --no-baseline \
    --attention-backend triton "$@"; }

step "$PY" benchmarks/gpu_check.py
for mode in fused separate; do
    flag=(); [ "$mode" = separate ] && flag=(--no-fused-decode)
    bench "${flag[@]}" --shape llama3-8b --batch-sizes 1,64 --input-len 1024 --output-len 64 \
        --result-file "$OUT/h200-fastpath-llama3-8b-$mode.json"
    bench "${flag[@]}" --shape smollm2-135m --batch-sizes 1 --input-len 128 --output-len 256 \
        --result-file "$OUT/h200-fastpath-smollm2-135m-$mode.json"
done
"$PY" benchmarks/summarize.py "$OUT"/h200-fastpath-*.json
step timeout "${SWEEP_TIMEOUT:-300}" "$PY" benchmarks/gpu_fastpath.py ${SWEEP:+--sweep}
exit $status

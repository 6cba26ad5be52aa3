#!/usr/bin/env bash
# The batch-1 decode path on one GPU, its three variants in the same run (--decode-path fused:
# GEMV kernels with RMSNorm and SiLU folded in; gemv: GEMV kernels, RMSNorm on its own;
# separate: cuBLAS and separate kernels, the earlier path), end to end (Llama-3-8B batch 1 and
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
for mode in fused gemv separate; do
    batches=1; [ "$mode" = fused ] && batches=1,64
    bench --decode-path "$mode" --shape llama3-8b --batch-sizes "$batches" --input-len 1024 \
        --output-len 128 --result-file "$OUT/h200-fastpath-llama3-8b-$mode.json"
    bench --decode-path "$mode" --shape smollm2-135m --batch-sizes 1 --input-len 128 \
        --output-len 512 --result-file "$OUT/h200-fastpath-smollm2-135m-$mode.json"
done
"$PY" benchmarks/summarize.py "$OUT"/h200-fastpath-*.json
step timeout "${SWEEP_TIMEOUT:-300}" "$PY" benchmarks/gpu_fastpath.py ${SWEEP:+--sweep} \
    ${SKIP_ATTENTION:+--skip-attention}
exit $status

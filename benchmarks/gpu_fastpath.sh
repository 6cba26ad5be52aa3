#!/usr/bin/env bash
# The decode fast path on one GPU, after the GPU correctness check: the engine's default
# (--decode-path fused: batch-1 GEMV kernels with RMSNorm and SiLU folded in, for weights up
# to 128 MB, the norm folded in up to 16 MB) beside transformers, on Llama-3-8B (batch 1 and 64 at 1k context, 8k prefill) and
# SmolLM2-135M (batch 1 and 32); in the same run the other batch-1 variants (gemv: RMSNorm on
# its own; separate: cuBLAS and separate kernels, the earlier path); then the kernel checks
# and timings of benchmarks/gpu_fastpath.py. Results go to $OUT (default benchmarks/results).
source "$(dirname "$0")/gpu_env.sh"
bench() { step "$PY" -m splitserve.cli bench offline --device cuda --no-baseline \
    --attention-backend triton "$@"; }

step "$PY" benchmarks/gpu_check.py
base() { step "$PY" -m splitserve.cli bench offline --device cuda --attention-backend triton "$@"; }
base --shape llama3-8b --batch-sizes 1 --input-len 1024 --output-len 64 --prefill-len 8192 \
    --result-file "$OUT/h200-fastpath-llama3-8b-b1.json"
bench --shape llama3-8b --batch-sizes 64 --input-len 1024 --output-len 64 \
    --result-file "$OUT/h200-fastpath-llama3-8b-b64.json"
base --shape smollm2-135m --batch-sizes 1,32 --input-len 128 --output-len 256 \
    --result-file "$OUT/h200-fastpath-smollm2-135m.json"
# The same run without parts of the path: the GEMV only up to 16 MB (all of Llama-3-8B's
# projections on cuBLAS), and the earlier cuBLAS path; with MODES="gemv separate" also the
# GEMV without the norm folded in.
bench --gemv-max-mb 16 --shape llama3-8b --batch-sizes 1 --input-len 1024 --output-len 64 \
    --result-file "$OUT/h200-fastpath-llama3-8b-b1-gemv16mb.json"
for mode in ${MODES:-separate}; do
    bench --decode-path "$mode" --shape llama3-8b --batch-sizes 1 --input-len 1024 \
        --output-len 64 --result-file "$OUT/h200-fastpath-llama3-8b-b1-$mode.json"
    bench --decode-path "$mode" --shape smollm2-135m --batch-sizes 1 --input-len 128 \
        --output-len 256 --result-file "$OUT/h200-fastpath-smollm2-135m-$mode.json"
done
"$PY" benchmarks/summarize.py "$OUT"/h200-fastpath-*.json
[ -n "${SKIP_KERNELS:-}" ] || step timeout "${SWEEP_TIMEOUT:-300}" "$PY" \
    benchmarks/gpu_fastpath.py ${SWEEP:+--sweep} ${SKIP_ATTENTION:+--skip-attention}
exit $status

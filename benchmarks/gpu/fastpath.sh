#!/usr/bin/env bash
# The decode fast path on one GPU, after the GPU correctness check: the engine's default
# (programmatic dependent launch; batch-1 GEMV kernels with RMSNorm and SiLU folded in for
# weights up to 256 MB; rotary and the K/V write inside decode attention) beside transformers,
# on Llama-3-8B (batch 1 and 64 at 1k context, 8k prefill) and SmolLM2-135M (batch 1 and 32);
# in the same run the batch-1 variants without parts of the path (--no-pdl; with
# MODES="separate gemv" the earlier cuBLAS path and the GEMV without the norm folded in); then
# the kernel checks and timings of benchmarks/gpu/fastpath.py. Results go to $OUT (default
# benchmarks/results); BUNDLE=1 packs them into $OUT/fastpath-results.tgz instead (the run
# writes ten or more files, more than some remote runners hand back).
source "$(dirname "$0")/../gpu_env.sh"
bench() { step "$PY" -m splitserve.cli bench offline --device cuda --no-baseline \
    --attention-backend triton "$@"; }
base() { step "$PY" -m splitserve.cli bench offline --device cuda --attention-backend triton "$@"; }
LLAMA_B1=(--shape llama3-8b --batch-sizes 1 --input-len 1024 --output-len 64)
SMOL_B1=(--shape smollm2-135m --batch-sizes 1 --input-len 128 --output-len 256)

step "$PY" -m benchmarks.gpu.check
base "${LLAMA_B1[@]}" --prefill-len 8192 --result-file "$OUT/h200-fastpath-llama3-8b-b1.json"
bench --shape llama3-8b --batch-sizes 64 --input-len 1024 --output-len 64 \
    --result-file "$OUT/h200-fastpath-llama3-8b-b64.json"
base --shape smollm2-135m --batch-sizes 1,32 --input-len 128 --output-len 256 \
    --result-file "$OUT/h200-fastpath-smollm2-135m.json"
bench "${SMOL_B1[@]}" --result-file "$OUT/h200-fastpath-smollm2-135m-b1-again.json"
bench --no-pdl "${LLAMA_B1[@]}" --result-file "$OUT/h200-fastpath-llama3-8b-b1-nopdl.json"
bench --no-pdl "${SMOL_B1[@]}" --result-file "$OUT/h200-fastpath-smollm2-135m-b1-nopdl.json"
for mode in ${MODES:-separate}; do
    bench --decode-path "$mode" "${LLAMA_B1[@]}" \
        --result-file "$OUT/h200-fastpath-llama3-8b-b1-$mode.json"
    bench --decode-path "$mode" "${SMOL_B1[@]}" \
        --result-file "$OUT/h200-fastpath-smollm2-135m-b1-$mode.json"
done
"$PY" -m benchmarks.summarize "$OUT"/h200-fastpath-*.json
step timeout 120 "$PY" -m benchmarks.profiling.step --shape smollm2-135m --batch 1 --steps 400 \
    | grep ms/step
[ -n "${SKIP_KERNELS:-}" ] || step timeout "${SWEEP_TIMEOUT:-300}" "$PY" \
    -m benchmarks.gpu.fastpath ${SWEEP:+--sweep} ${SKIP_ATTENTION:+--skip-attention}
if [ -n "${BUNDLE:-}" ]; then
    (cd "$OUT" && tar -czf fastpath-results.tgz ./*.json && rm -f ./*.json)
fi
exit $status

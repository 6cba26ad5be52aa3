#!/usr/bin/env bash
# Overlapped decode scheduling on one GPU, beside synchronous steps in the same run: the GPU
# correctness check (overlap is on by default on CUDA, so it runs through it), then decode
# throughput of the SmolLM2-135M and Llama-3-8B shapes (Triton attention, CUDA graphs) with
# and without --no-overlap. Results go to $OUT (default benchmarks/results).
source "$(dirname "$0")/../gpu_env.sh"
bench() { step "$PY" -m splitserve.cli bench offline --device cuda --no-baseline \
    --attention-backend triton "$@"; }

step "$PY" -m benchmarks.gpu.check
for mode in overlap sync; do
    flag=(); [ "$mode" = sync ] && flag=(--no-overlap)
    bench "${flag[@]}" --shape smollm2-135m --batch-sizes 1,32 --input-len 128 \
        --output-len 256 --result-file "$OUT/h200-overlap-smollm2-135m-$mode.json"
    bench "${flag[@]}" --shape llama3-8b --batch-sizes 1,64 --input-len 1024 --output-len 64 \
        --result-file "$OUT/h200-overlap-llama3-8b-$mode.json"
done
"$PY" -m benchmarks.summarize "$OUT"/h200-overlap-*.json
exit $status

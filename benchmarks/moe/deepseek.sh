#!/usr/bin/env bash
# DeepSeek on one H200 (issue 41; record in docs/performance.md): the MLA decode kernel
# against its torch reference at batch 64 and 1k-32k context; the engine on
# shape:deepseek-v2-lite and on four full-width DeepSeek-V3 layers (shape:deepseek-v3?layers=4)
# at batch 1, 64 and 256 (MBU on the routed experts and latent cache a step reads,
# bench/roofline.py) with an 8k prefill (MFU). Results to $OUT (default benchmarks/results).
source "$(dirname "$0")/../gpu_env.sh"
step timeout 90 "$PY" -m benchmarks.kernels.mla_decode --batch 64 --heads 16,128 \
    --contexts 1024,4096,16384,32768
for shape in deepseek-v2-lite "deepseek-v3?layers=4"; do
    step timeout "${LIMIT:-150}" "$PY" -m splitserve.cli bench offline --device cuda --no-baseline \
        --attention-backend triton --shape "$shape" --batch-sizes 1,64,256 --input-len 256 \
        --output-len 64 --prefill-len 8192 --gpu-memory-utilization 0.5 \
        --result-file "$OUT/h200-deepseek-${shape%%\?*}.json"
done
exit $status

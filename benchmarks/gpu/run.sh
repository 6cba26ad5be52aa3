#!/usr/bin/env bash
# The whole GPU suite in one go (about 10 minutes on one or two H200s): correctness on the GPU,
# kernel checks, offline engine throughput beside transformers for the SmolLM2 and Llama-3-8B
# shapes (torch and Triton attention; Llama-3-8B on Triton also beside the compiled-PyTorch peer,
# `--peer compiled`), and, with two GPUs, the KV transfer / disaggregation
# benchmark over NCCL. Runs from a plain copy of the tree with the machine's own python3
# (torch, triton, transformers; no network); results go to $OUT (default benchmarks/results).
source "$(dirname "$0")/../gpu_env.sh"

step "$PY" -m benchmarks.gpu.check
step "$PY" -m benchmarks.kernels.triton_kernels
bench() { step "$PY" -m splitserve.cli bench offline --device cuda "$@"; }
bench --shape smollm2-135m --batch-sizes 1,32 --input-len 128 --output-len 128 \
    --result-file "$OUT/h200-offline-smollm2-135m.json"
bench --shape smollm2-135m --batch-sizes 1,32 --input-len 128 --output-len 128 --no-baseline \
    --attention-backend triton --result-file "$OUT/h200-offline-smollm2-135m-triton.json"
bench --shape llama3-8b --batch-sizes 1,64 --input-len 1024 --output-len 64 --prefill-len 8192 \
    --result-file "$OUT/h200-offline-llama3-8b.json"
bench --shape llama3-8b --batch-sizes 1,64 --input-len 1024 --output-len 64 --prefill-len 8192 \
    --peer compiled --attention-backend triton --result-file "$OUT/h200-offline-llama3-8b-triton.json"
if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ] \
    && [ -f benchmarks/gpu/disagg.py ]; then
    step "$PY" -m benchmarks.gpu.disagg
fi
"$PY" -m benchmarks.summarize "$OUT"/h200-offline-*.json
exit $status

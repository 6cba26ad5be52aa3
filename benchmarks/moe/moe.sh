#!/usr/bin/env bash
# MoE on one H200 (issue 19; the record is in docs/performance.md): the grouped expert GEMM
# against a per-expert loop of cuBLAS calls (Qwen3-30B-A3B experts, 1 / 64 / 256 tokens); the engine's decode of
# shape:qwen3-30b-a3b (EP = 1) at batch 1, 64 and 256 with MBU of the weights the step reads
# (routed experts counted, bench/roofline.py); transformers on the same shape in its own
# process (two 61 GB copies do not fit one GPU). Results to $OUT (default benchmarks/results).
source "$(dirname "$0")/../gpu_env.sh"
step "$PY" -m benchmarks.moe.moe gemm --batch-sizes 1,64,256
step "$PY" -m splitserve.cli bench offline --device cuda --no-baseline --attention-backend triton \
    --shape qwen3-30b-a3b --batch-sizes 1,64,256 --input-len 256 --output-len 64 \
    --gpu-memory-utilization 0.5 --result-file "$OUT/h200-moe-qwen3-30b-a3b.json"
step "$PY" -m benchmarks.moe.moe hf --shape qwen3-30b-a3b --batch-sizes 1,64,256
exit $status

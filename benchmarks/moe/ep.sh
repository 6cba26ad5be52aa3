#!/usr/bin/env bash
# Expert parallelism on the GPUs of one host (issue 19), each rank one GPU, NCCL between them:
# the MoE layer of a group against one GPU before and after an EPLB weight move and the
# all-to-all's time (ep_check.py: $OUT/a2a.json), the EPLB simulator with that and the
# H200 grouped-GEMM measurement as its costs, then the service with a colocated pool as one
# expert-parallel group against the same GPUs as data-parallel replicas (ep_served.py):
# shape:tiny-mixtral, then shape:qwen3-30b-a3b (extra arguments go to that run). The GPU hosts lack Ray, pyzmq,
# FastAPI and uvicorn: carry .gpu-bundle (../shared/tools/gpu-bundle.sh); this unpacks it.
source "$(dirname "$0")/../gpu_env.sh"
mkdir -p /tmp/site && tar xJf .gpu-bundle/site.txz -C /tmp/site
export PYTHONPATH="/tmp/site:$PYTHONPATH"
gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
step "$PY" -m benchmarks.moe.ep_check
step "$PY" -m splitserve.cli bench eplb --ranks 8 16 32 64 --experts 128 --top-k 8 --steps 300 \
    --tokens-per-step 2048 --layers 2 --interval 100 --exponent 0.5 \
    --gemm-costs benchmarks/results/moe-h200/moe-gemm.json --a2a-costs "$OUT/a2a.json" \
    --out "$OUT/eplb-measured-costs.json"
step "$PY" -m benchmarks.moe.ep_served --model shape:tiny-mixtral --gpus "$gpus" \
    --num-prompts 64 --input-len 64 --output-len 32 --out "$OUT/tiny-mixtral"
step "$PY" -m benchmarks.moe.ep_served --model shape:qwen3-30b-a3b --gpus "$gpus" "$@"
exit $status

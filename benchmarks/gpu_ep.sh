#!/usr/bin/env bash
# Expert parallelism on the GPUs of one host (issue 19), each rank one GPU, NCCL between them:
# the MoE layer of a group against one GPU before and after an EPLB weight move
# (gpu_ep_check.py), then the service with a colocated pool as one expert-parallel group
# against the same GPUs as data-parallel replicas (gpu_ep_served.py): shape:tiny-mixtral,
# then shape:qwen3-30b-a3b (extra arguments go to that run). The GPU hosts lack Ray, pyzmq,
# FastAPI and uvicorn: carry .gpu-bundle (../shared/tools/gpu-bundle.sh); this unpacks it.
source "$(dirname "$0")/gpu_env.sh"
mkdir -p /tmp/site && tar xJf .gpu-bundle/site.txz -C /tmp/site
export PYTHONPATH="/tmp/site:$PYTHONPATH"
gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
step "$PY" benchmarks/gpu_ep_check.py
step "$PY" benchmarks/gpu_ep_served.py --model shape:tiny-mixtral --gpus "$gpus" \
    --num-prompts 64 --input-len 64 --output-len 32 --out "$OUT/tiny-mixtral"
step "$PY" benchmarks/gpu_ep_served.py --model shape:qwen3-30b-a3b --gpus "$gpus" "$@"
exit $status

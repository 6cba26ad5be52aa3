#!/usr/bin/env bash
# FP8 on one H200 (issue 42; the record is in docs/performance.md): the FP8 GEMMs on
# Llama-3-8B's projections beside bfloat16 and torch._scaled_mm (and, with SWEEP=1, a sweep of
# their tilings); the engine on shape:llama3-8b in bfloat16, with FP8 weights, and with an FP8
# KV cache (decode at batch 1 and 64, an 8k prefill; the KV cache at batch 64 and 8k context),
# and shape:qwen3-30b-a3b at batch 64 in bfloat16 and FP8. Each comparison in one run.
# PARTS picks what runs (default: every part but served): kernels, llama, kv, moe, served (the
# service with each setting: about 10 minutes).
source "$(dirname "$0")/../gpu_env.sh"
PARTS=${PARTS:-kernels llama kv moe}
bench() { step timeout "${LIMIT:-240}" "$PY" -m splitserve.cli bench offline --device cuda \
    --no-baseline --attention-backend triton "$@"; }
for part in $PARTS; do
    case $part in
    kernels)
        [ "${SWEEP:-0}" = 1 ] || step "$PY" -m benchmarks.kernels.fp8_gemm
        if [ "${SWEEP:-0}" = 1 ]; then step "$PY" -m benchmarks.kernels.fp8_gemm --sweep; fi ;;
    llama)
        for q in "" "--quantization fp8"; do
            bench --shape llama3-8b --batch-sizes 1,64 --input-len 1024 --output-len 64 \
                --prefill-len 8192 $q --result-file "$OUT/fp8-llama3-8b${q:+-fp8}.json"
        done ;;
    kv)
        # 64 requests of 8k tokens hold 68 GB of bfloat16 cache: on an H200 (141 GB) they fit
        # beside the weights at 0.9 of its memory; on an 80 GB H100 64 of 4k do. At the
        # default 0.4 they did not fit, and preempted requests were prefilled again inside the
        # decode window (1.9% MBU). 8k-token steps and 256 tokens out, so that every request
        # decodes at once for a while.
        mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
        context=$(( mib > 100000 ? 8192 : 4096 ))
        for kv in auto fp8; do
            bench --shape llama3-8b --batch-sizes 64 --input-len $context --output-len 256 \
                --prefill-len 8192 --gpu-memory-utilization 0.9 --kv-cache-dtype $kv \
                --result-file "$OUT/fp8-llama3-8b-kv-$kv.json"
        done ;;
    moe)
        for q in "" "--quantization fp8"; do
            bench --shape qwen3-30b-a3b --batch-sizes 64 --input-len 256 --output-len 64 \
                --gpu-memory-utilization 0.5 $q --result-file "$OUT/fp8-qwen3${q:+-fp8}.json"
        done ;;
    served)
        # The service, colocated on one GPU, 1024/128: bfloat16, FP8 weights, FP8 KV cache,
        # one after another in this call (saturation against the offline engine, goodput).
        for setting in "" quantization=fp8 kv_cache_dtype=fp8; do
            name=${setting:-bf16}
            mkdir -p "$OUT/served-${name%%=*}"
            step timeout "${LIMIT:-300}" bash benchmarks/served/gpu_comparison.sh \
                --model shape:llama3-8b --mixes 1024/128 --rates "${RATES:-8,16,32}" \
                --num-prompts "${PROMPTS:-100}" --out "$OUT/served-${name%%=*}" \
                ${setting:+--set "pools.*.engine.$setting"}
        done ;;
    esac
done
exit $status

#!/usr/bin/env bash
# DeepSeek-V4 on one H200 (issue 44; record in docs/performance.md): its decode kernels against
# their torch references at batch 1, 64 and 256 and 4k-128k context (kernels/v4_decode.py),
# then the engine on four full-width V4-Flash layers (shape:deepseek-v4-flash?layers=4: HCA,
# HCA, HCA, CSA, the first three MoE layers hash-routed, the fourth top-k; V4-Flash has no
# sliding-only layer) at batch 1, 64 and 256 with the bytes a decode step reads
# (bench/v4_roofline.py) and its MBU, decode in CUDA graphs, and an 8k prefill (MFU). Each step
# runs under `timeout` (at most 7.5 minutes in all, 10 where the engine fails and runs again
# without CUDA graphs). Results to $OUT (default benchmarks/results): v4-decode.json,
# v4-prefill.json and h200-deepseek-v4-flash.json (h200-deepseek-v4-flash-eager.json from that
# second run).
#
# PARTS picks what runs (default all three): kernels, prefill (one layer's 8k-token prefill
# attention, HCA and CSA: the blocked torch path and HCA's kernel against the old path,
# benchmarks/kernels/v4_prefill.py; v4-prefill.json), engine.
#
# To check the script on the CPU (the kernels' tiny shape through Triton's interpreter, the
# engine at small sizes): DEVICE=cpu SHAPE=tiny-deepseek-v4 bash benchmarks/moe/deepseek_v4.sh
source "$(dirname "$0")/../gpu_env.sh"
export OUT  # the Python benchmarks write their JSON there
SHAPE=${SHAPE:-deepseek-v4-flash?layers=4}
DEVICE=${DEVICE:-cuda}
if [ "$DEVICE" = cpu ]; then
    export TRITON_INTERPRET=1
    kernels=(--smoke --batches 1,4 --contexts 64,200)
    prefill=(--device cpu --reduced --tokens 1024)
    engine=(--device cpu --batch-sizes 1,4 --input-len 32 --output-len 8 --prefill-len 128)
    result="$OUT/cpu-${SHAPE%%\?*}.json"
else
    kernels=(--batches 1,64,256 --contexts 4096,16384,65536,131072)
    prefill=(--tokens 8192)
    engine=(--device cuda --attention-backend triton --gpu-memory-utilization 0.5
        --batch-sizes 1,64,256 --input-len 256 --output-len 64 --prefill-len 8192)
    result="$OUT/h200-${SHAPE%%\?*}.json"
fi
PARTS=${PARTS:-kernels prefill engine}
if [[ " $PARTS " == *" kernels "* ]]; then
    step timeout 120 "$PY" -m benchmarks.kernels.v4_decode "${kernels[@]}"
fi
if [[ " $PARTS " == *" prefill "* ]]; then
    step timeout 150 "$PY" -m benchmarks.kernels.v4_prefill "${prefill[@]}"
fi
[[ " $PARTS " == *" engine "* ]] || exit $status
offline=("$PY" -m splitserve.cli bench offline --no-baseline --shape "$SHAPE" "${engine[@]}")
echo "== ${offline[*]} --result-file $result"
if ! timeout 180 "${offline[@]}" --result-file "$result"; then
    # V4's decode steps in CUDA graphs have not run on a GPU before this script: if they
    # fail, the same run eagerly (no graphs, no overlapped steps)
    echo "!! failed; again without CUDA graphs"
    status=1
    step timeout 150 "${offline[@]}" --no-cuda-graphs --no-overlap --result-file "${result%.json}-eager.json"
fi
exit $status

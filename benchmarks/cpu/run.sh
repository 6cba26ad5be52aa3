#!/usr/bin/env bash
# The CPU benchmark suite (`make bench`): offline engine throughput beside transformers and
# llama.cpp on the same GGUF file (SmolLM2-135M's Q4_1 file, then Gemma 3 270M's Q4_K_M file),
# then serving throughput/latency of colocated against 1 prefill + 1 decode at three request
# rates.
# Results: benchmarks/results/make-bench-vm2c/cpu-*.json and cpu-*.png (RESULTS=DIR: elsewhere;
# OFFLINE=0: the serving part alone; SMOLLM2=0, GEMMA=0, SERVING=0: without that part; RATES,
# PROMPTS: the serving sweep). The Gemma part records the machine's load average before and
# after it (cpu-gemma3-loadavg.txt).
#
# llama.cpp comes from llama-cpp-python, built here into its own virtual environment
# (.bench/llamacpp, not the project's): portable flags, AVX-512 only where the CPU has it (a
# native build uses AMX and dies with "Illegal instruction" in some sandboxes). LLAMACPP=0
# skips it.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-.venv/bin}
OUT=${RESULTS:-benchmarks/results/make-bench-vm2c}
RATES=${RATES:-0.5,1,2}
PROMPTS=${PROMPTS:-24}
mkdir -p "$OUT"

llamacpp_venv() {  # builds llama-cpp-python into .bench/llamacpp once
    LLAMA_VENV=.bench/llamacpp
    if [ ! -x "$LLAMA_VENV/bin/python" ] || ! "$LLAMA_VENV/bin/python" -c 'import llama_cpp' 2>/dev/null; then
        python3 -m venv "$LLAMA_VENV"
        avx512=OFF
        grep -qw avx512f /proc/cpuinfo && avx512=ON
        CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=$avx512 -DGGML_FMA=ON -DGGML_F16C=ON" \
            "$LLAMA_VENV/bin/pip" install llama-cpp-python
    fi
}

llamacpp_decode() {  # $1 model name, $2 result file: llama.cpp's batch-1 decode on its GGUF file
    local gguf
    gguf=$("$BIN/python" -c "from splitserve.engine.loader import resolve_model; print(resolve_model('$1'))")
    "$LLAMA_VENV/bin/python" -m benchmarks.cpu.llamacpp_decode --model "$gguf" --input-len 128 \
        --output-len 128 > "$2"
}

if [ "${OFFLINE:-1}" != 0 ] && [ "${SMOLLM2:-1}" != 0 ]; then
    "$BIN/splitserve" bench offline --batch-sizes 1,32 --input-len 128 --output-len 128 \
        --result-file "$OUT/cpu-offline-smollm2.json"
    "$BIN/splitserve" bench offline --batch-sizes 1,32 --input-len 128 --output-len 128 \
        --dtype float32 --no-native --no-baseline --result-file "$OUT/cpu-offline-smollm2-float32.json"
    # The opt-in bfloat16 weights (oneDNN; not the oracle's arithmetic, docs/performance.md).
    "$BIN/splitserve" bench offline --batch-sizes 1,32 --input-len 128 --output-len 128 \
        --cpu-weights bfloat16 --no-baseline --result-file "$OUT/cpu-offline-smollm2-bf16.json"

    if [ "${LLAMACPP:-1}" != 0 ]; then
        llamacpp_venv
        llamacpp_decode smollm2-135m-instruct "$OUT/cpu-llamacpp-smollm2.json"
        "$BIN/python" -m benchmarks.cpu.versus_llamacpp "$OUT/cpu-offline-smollm2.json" \
            "$OUT/cpu-llamacpp-smollm2.json" "$OUT/cpu-offline-smollm2-float32.json" \
            "$OUT/cpu-offline-smollm2-bf16.json"
    fi
fi

# Gemma 3 270M's Q4_K_M file (Q5_0, Q8_0, Q4_K, Q6_K blocks, all kept packed): the engine at
# batch 1 and 32 beside llama.cpp's batch 1 on the same file (issue 43). transformers is
# skipped: it loads this file's 262k-token vocabulary for minutes.
if [ "${OFFLINE:-1}" != 0 ] && [ "${GEMMA:-1}" != 0 ]; then
    cat /proc/loadavg > "$OUT/cpu-gemma3-loadavg.txt"
    "$BIN/splitserve" bench offline --model gemma3-270m --batch-sizes 1,32 --input-len 128 \
        --output-len 128 --no-baseline --result-file "$OUT/cpu-offline-gemma3.json"
    if [ "${LLAMACPP:-1}" != 0 ]; then
        llamacpp_venv
        llamacpp_decode gemma3-270m "$OUT/cpu-llamacpp-gemma3.json"
        "$BIN/python" -m benchmarks.cpu.versus_llamacpp "$OUT/cpu-offline-gemma3.json" \
            "$OUT/cpu-llamacpp-gemma3.json" --out cpu-versus-llamacpp-gemma3.json
    fi
    cat /proc/loadavg >> "$OUT/cpu-gemma3-loadavg.txt"
fi

free_port() { "$BIN/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

serve_and_bench() {  # $1 config file, $2 tag, then --set overrides
    local port pid config=$1 tag=$2
    shift 2
    port=$(free_port)
    "$BIN/splitserve" serve --config "$config" --set server.port="$port" "$@" \
        >"$OUT/cpu-serve-$tag.log" 2>&1 &
    pid=$!
    for _ in $(seq 240); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
        kill -0 "$pid" 2>/dev/null || { echo "server for $tag died; see $OUT/cpu-serve-$tag.log"; exit 1; }
        sleep 1
    done
    "$BIN/splitserve" bench serve --base-url "http://127.0.0.1:$port" --endpoint completions \
        --dataset random --random-input-len 256 --random-output-len 64 --ignore-eos \
        --num-prompts "$PROMPTS" --sweep-rates "$RATES" --seed 0 \
        --tokenizer smollm2-135m-instruct --disable-tqdm \
        --result-file "$OUT/cpu-serve-$tag.json" --plot-file "$OUT/cpu-serve-$tag.png" || true
    kill -TERM "$pid"
    wait "$pid" || true
}

if [ "${SERVING:-1}" != 0 ]; then
    serve_and_bench configs/colocated.yaml colocated
    serve_and_bench configs/local.yaml 1p1d
    # The same deployment on float32 weights (the engine before GGUF blocks were kept): the
    # served gain, beside the offline one.
    serve_and_bench configs/local.yaml 1p1d-float32 --set pools.prefill.engine.dtype=float32 \
        --set pools.decode.engine.dtype=float32
    # Prefill on the opt-in bfloat16 weights (its compute-bound GEMMs 2-3x faster on
    # AVX512-BF16), decode on the GGUF blocks (bandwidth-bound): the pools' engines differ.
    serve_and_bench configs/local.yaml 1p1d-bf16-prefill --set pools.prefill.engine.cpu_weights=bfloat16
fi
"$BIN/python" -m benchmarks.summarize "$OUT"/cpu-*.json

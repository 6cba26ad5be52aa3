#!/usr/bin/env bash
# Deterministic mode on one GPU (issue 45; about 5-8 minutes on an H200, not timed yet), bf16,
# random weights:
# (a) the batch-invariant kernels at Llama-3-8B's sizes: the matmul's rows 1..256 bitwise equal
#     on every projection and the LM head, the attention's rows equal as one chunk, two chunks
#     (cached prefix) and decode rows alone or batched; errors and timings beside the default
#     kernels (deterministic-kernels.json);
# (b) the engine on shape:llama3-8b: a probe prompt alone and amid 1 to 255 other prompts of
#     mixed lengths, chunked 2048 and 64 tokens a step, with and without a prefix-cache hit: the
#     same logprob bits for every generated token, the same seeded temperature-1 tokens, also
#     prefilled on one engine and decoded on another (1P1D, the KV handed over in-process);
#     then the same on a mixture of experts, the first 4 layers of Qwen3-30B-A3B (up to 63
#     others) (deterministic-engine-<shape>.json);
# (d) in (b)'s runs, n-gram speculative decoding (both shapes) and a draft model equal to the
#     target (Llama-3-8B; every draft accepted) giving plain greedy's tokens and logprobs;
# (c) the price: `splitserve bench offline` on shape:llama3-8b with and without --deterministic
#     (decode at batch 1 and 64 after 1024-token prompts, one 8192-token prefill) and their ratio
#     (deterministic-price*.json).
# Results go to $OUT (default benchmarks/results); a failed check fails the script. PARTS
# (default "kernels engine moe price") picks the groups, e.g. to split the run over two calls.
source "$(dirname "$0")/../gpu_env.sh"

PARTS=${PARTS:-kernels engine moe price}
if [[ " $PARTS " == *" kernels "* ]]; then
    step "$PY" -m benchmarks.gpu.deterministic_kernels
fi
if [[ " $PARTS " == *" engine "* ]]; then
    step "$PY" -m benchmarks.gpu.deterministic_engine --model shape:llama3-8b
fi
if [[ " $PARTS " == *" moe "* ]]; then
    step "$PY" -m benchmarks.gpu.deterministic_engine --model "shape:qwen3-30b-a3b?layers=4" \
        --max-others 63 --no-draft-model
fi
if [[ " $PARTS " == *" price "* ]]; then
    bench() { step "$PY" -m splitserve.cli bench offline --device cuda --no-baseline \
        --shape llama3-8b --batch-sizes 1,64 --input-len 1024 --output-len 64 \
        --prefill-len 8192 "$@"; }
    bench --result-file "$OUT/deterministic-price-default.json"
    bench --deterministic --result-file "$OUT/deterministic-price-deterministic.json"
    step "$PY" -m benchmarks.gpu.deterministic_price "$OUT/deterministic-price-default.json" \
        "$OUT/deterministic-price-deterministic.json"
fi
exit $status

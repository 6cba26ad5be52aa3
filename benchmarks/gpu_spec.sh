#!/usr/bin/env bash
# Speculative decoding on one GPU (H200), beside plain decode in the same run: random weights
# of the Llama-3-8B shape, a draft model equal to the target (the same shape and seed, so every
# draft is accepted: the upper bound of the verification machinery), k = 2, 4, 8 at batch 1
# and 16, dynamic off (every step verifies k drafts); then n-gram drafts on random prompts
# with dynamic verification on (drafts are rarely proposed: the cost of having it on).
# Not run by the author (no device time was used); results go to $OUT (default
# benchmarks/results).
source "$(dirname "$0")/gpu_env.sh"
bench() { step "$PY" -m splitserve.cli bench offline --device cuda --no-baseline \
    --attention-backend triton --shape llama3-8b --batch-sizes 1,16 --input-len 256 \
    --output-len 128 --spec-workloads random --ignore-eos --gpu-memory-utilization 0.2 "$@"; }

for k in 2 4 8; do
    bench --speculative draft_model --draft-model shape:llama3-8b --no-dynamic \
        --num-speculative-tokens "$k" --result-file "$OUT/h200-spec-draft-equal-k$k.json"
done
bench --speculative ngram --num-speculative-tokens 4 --result-file "$OUT/h200-spec-ngram-dynamic.json"
exit $status

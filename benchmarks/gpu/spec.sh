#!/usr/bin/env bash
# Speculative decoding on one GPU (H200), beside plain decode in the same run (random weights
# of the Llama-3-8B shape, bf16, batch 1 and 16, greedy, 256-token prompts, 128 output tokens):
# - a draft model equal to the target (the same shape and seed: every draft is accepted, the
#   upper bound of the verification machinery), k = 2, 4, 8, dynamic off;
# - a draft of another seed (almost nothing accepted), k = 4: dynamic off (every step pays a
#   k-token verify: the overhead) and dynamic on (the planner must stop drafting);
# - n-gram drafts on random prompts with dynamic verification on.
# Verify steps run as decode rows in CUDA graphs (engine/cuda_graphs.py). Results go to $OUT
# (default benchmarks/results). PARTS (default "equal rejected ngram") picks the groups.
source "$(dirname "$0")/../gpu_env.sh"
bench() { step "$PY" -m splitserve.cli bench offline --device cuda --no-baseline \
    --attention-backend triton --shape llama3-8b --batch-sizes 1,16 --input-len 256 \
    --output-len 128 --spec-workloads random --ignore-eos --gpu-memory-utilization 0.2 "$@"; }

PARTS=${PARTS:-equal rejected ngram}
if [[ " $PARTS " == *" equal "* ]]; then
    for k in 2 4 8; do
        bench --speculative draft_model --draft-model shape:llama3-8b --no-dynamic \
            --num-speculative-tokens "$k" --result-file "$OUT/h200-spec-draft-equal-k$k.json"
    done
fi
if [[ " $PARTS " == *" rejected "* ]]; then
    bench --speculative draft_model --draft-model shape:llama3-8b --draft-seed 1 --no-dynamic \
        --num-speculative-tokens 4 --result-file "$OUT/h200-spec-draft-rejected-k4.json"
    bench --speculative draft_model --draft-model shape:llama3-8b --draft-seed 1 \
        --num-speculative-tokens 4 --result-file "$OUT/h200-spec-draft-rejected-k4-dynamic.json"
fi
if [[ " $PARTS " == *" ngram "* ]]; then
    bench --speculative ngram --num-speculative-tokens 4 \
        --result-file "$OUT/h200-spec-ngram-dynamic.json"
fi
exit $status

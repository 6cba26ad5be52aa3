#!/usr/bin/env bash
# Speculative decoding on one GPU (H200), beside plain decode in the same run (random weights
# of the Llama-3-8B shape, bf16, batch 1 and 16, greedy, 256-token prompts, 128 output tokens):
# plain decoding, fixed k = 2, 4, 8 and dynamic verification (at most 8) in one run each:
# - a draft model equal to the target (the same shape and seed: every draft is accepted, the
#   upper bound of the verification machinery);
# - a draft of another seed (almost nothing accepted: dynamic must stop drafting);
# - n-gram drafts on random prompts.
# Verify steps run as decode rows in CUDA graphs (engine/cuda_graphs.py). Results go to $OUT
# (default benchmarks/results). PARTS (default "equal rejected ngram") picks the groups.
source "$(dirname "$0")/../gpu_env.sh"
bench() { step "$PY" -m splitserve.cli bench offline --device cuda --no-baseline \
    --attention-backend triton --shape llama3-8b --batch-sizes 1,16 --input-len 256 \
    --output-len 128 --spec-workloads random --ignore-eos --gpu-memory-utilization 0.2 "$@"; }

PARTS=${PARTS:-equal rejected ngram}
if [[ " $PARTS " == *" equal "* ]]; then
    bench --speculative draft_model --draft-model shape:llama3-8b \
        --result-file "$OUT/h200-spec-draft-equal.json"
fi
if [[ " $PARTS " == *" rejected "* ]]; then
    bench --speculative draft_model --draft-model shape:llama3-8b --draft-seed 1 \
        --result-file "$OUT/h200-spec-draft-rejected.json"
fi
if [[ " $PARTS " == *" ngram "* ]]; then
    bench --speculative ngram --result-file "$OUT/h200-spec-ngram.json"
fi
exit $status

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
#
# PARTS=issue49: issue 49's table, batch 1 and 8, 64 output tokens, plain, k = 2, 4, 8 and
# dynamic, for n-gram drafts and for a small shape: draft (the target's first two layers and
# seed, about 1/16 of its step, whose drafts a deeper random target almost never accepts: 0 of
# 228 for one layer against two on the CPU). Random
# weights take no chat prompt and never copy their context, so the text workloads (copy,
# grounded, free, mixed) need a real checkpoint: here every workload is `random`, where
# dynamic verification must stay at plain decoding. Two runs of five engines (about 90 GB of
# weights with the drafts), estimated at 3 minutes on an H200.
# SHAPE and DRAFT override the shapes (a CPU check: DEVICE=cpu SHAPE=tiny-llama
# DRAFT=shape:tiny-llama?layers=1 PARTS=issue49).
source "$(dirname "$0")/../gpu_env.sh"
DEVICE=${DEVICE:-cuda}
SHAPE=${SHAPE:-llama3-8b}
DRAFT=${DRAFT:-shape:$SHAPE?layers=2}
BACKEND=$([[ $DEVICE == cuda ]] && echo triton || echo auto)
bench() { step "$PY" -m splitserve.cli bench offline --device "$DEVICE" --no-baseline \
    --attention-backend "$BACKEND" --shape "$SHAPE" --batch-sizes 1,16 --input-len 256 \
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
if [[ " $PARTS " == *" issue49 "* ]]; then
    bench --speculative ngram --batch-sizes 1,8 --output-len 64 \
        --result-file "$OUT/$DEVICE-spec49-ngram.json"
    bench --speculative draft_model --draft-model "$DRAFT" --batch-sizes 1,8 --output-len 64 \
        --result-file "$OUT/$DEVICE-spec49-draft.json"
fi
exit $status

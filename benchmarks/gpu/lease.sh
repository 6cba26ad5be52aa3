#!/usr/bin/env bash
# One device call's driver: unpacks .gpu-bundle (when carried), runs the named benchmark
# scripts one after another, each under its own time limit, with their results in a scratch
# folder, and packs that folder into $OUT/results.tgz with the log (the device tool brings back
# at most 8 files, so the many JSON files travel as one archive).
#   bash benchmarks/gpu/lease.sh SECONDS "COMMAND" [SECONDS "COMMAND" ...]
# e.g. bash benchmarks/gpu/lease.sh 200 "bash benchmarks/moe/deepseek.sh" 240 "PARTS=llama bash benchmarks/gpu/fp8.sh"
set -uo pipefail
cd "$(dirname "$0")/../.."
final=${OUT:-benchmarks/results}
work=$(mktemp -d)
if [ -f .gpu-bundle/site.txz ]; then
    mkdir -p /tmp/site && tar xJf .gpu-bundle/site.txz -C /tmp/site
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
summary=()
while [ $# -ge 2 ]; do
    limit=$1 cmd=$2; shift 2
    echo "=== [$limit s] $cmd"
    start=$(date +%s)
    OUT=$work timeout "$limit" bash -c "$cmd" 2>&1 | tee -a "$work/log.txt"
    rc=${PIPESTATUS[0]}
    summary+=("rc=$rc $(( $(date +%s) - start ))s  $cmd")
    tar czf "$final/results.tgz" -C "$work" .
done
printf '%s\n' "${summary[@]}"

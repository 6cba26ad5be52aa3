#!/usr/bin/env bash
# The KV cache system on one GPU (benchmarks/served/kv_cache.py): prefix caching on against
# off on shared-prefix and multi-turn loads, and the host tier's hit path, colocated,
# shape:llama3-8b. Carry .gpu-bundle (../shared/tools/gpu-bundle.sh); results to $OUT: the
# summary kv-cache.json, the log, and every bench record in runs.tgz.
#
#   bash benchmarks/served/gpu_kv_cache.sh [kv_cache.py arguments]
source "$(dirname "$0")/../gpu_env.sh"
mkdir -p /tmp/site && tar xJf .gpu-bundle/site.txz -C /tmp/site
export PYTHONPATH="/tmp/site:$PYTHONPATH" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -m benchmarks.served.kv_cache --out "$OUT" "$@" 2>&1 | tee "$OUT/run.log" || status=1
tar czf "$OUT/runs.tgz" -C "$OUT" runs && rm -r "$OUT/runs"
exit $status

# Sourced by the GPU benchmark scripts: run from the repository root on a plain copy of the
# tree with the machine's own python3; results to $OUT (default benchmarks/results); `step`
# runs a command, logs it, and records a failure in $status without stopping the script.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export SPLITSERVE_GIT_COMMIT=${SPLITSERVE_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-benchmarks/results}
PY=${PY:-python3}
mkdir -p "$OUT"
status=0
step() { echo "== $*"; "$@" || { echo "!! failed: $*"; status=1; }; }

#!/usr/bin/env bash
# The served comparison on this machine's GPUs (benchmarks/served/comparison.py): one GPU runs
# colocated against the offline engine; two add 1P1D against colocated with 2 replicas. The GPU
# hosts lack Ray, pyzmq, FastAPI and uvicorn: carry .gpu-bundle (../shared/tools/gpu-bundle.sh)
# and this unpacks it. With PROFILE=1 (and a py-spy wheel in .whl/) the first rate of the first
# deployment is sampled with py-spy (every Ray worker and the server, 20 s) into $OUT/pyspy.tgz;
# PROFILE_MATCH picks another run by its bench command line (e.g. "request-rate inf": the
# saturation run), PROFILE_DELAY and PROFILE_SECONDS when and how long (8 s, 20 s).
#
#   bash benchmarks/served/gpu_comparison.sh [comparison.py arguments]
source "$(dirname "$0")/../gpu_env.sh"
mkdir -p /tmp/site && tar xJf .gpu-bundle/site.txz -C /tmp/site
export PYTHONPATH="/tmp/site:$PYTHONPATH"
if [ "${PROFILE:-0}" = 1 ]; then
    "$PY" -m pip install -q --no-deps --no-index --target /tmp/pyspy .whl/py_spy-*.whl
    mkdir -p /tmp/pyspy-out
    (
        until pgrep -f "splitserve.cli bench serve.*${PROFILE_MATCH:-}" >/dev/null; do sleep 1; done
        sleep "${PROFILE_DELAY:-8}"  # past the first requests' prefill: the steady state
        for pid in $(pgrep -f "ray::[A-Za-z]*Worker|splitserve.cli serve|splitserve.cli bench serve"); do
            name=$(tr '\0' ' ' </proc/"$pid"/cmdline | cut -c1-40 | tr -c 'A-Za-z0-9\n' _)
            /tmp/pyspy/bin/py-spy record --nonblocking --threads --idle --format raw -r 200 -d "${PROFILE_SECONDS:-20}" -p "$pid" \
                -o "/tmp/pyspy-out/$pid-$name.txt" >"/tmp/pyspy-out/$pid.log" 2>&1 &
        done
        wait
        tar czf "$OUT/pyspy.tgz" -C /tmp/pyspy-out .
    ) &
    profiler=$!
fi
step "$PY" -m benchmarks.served.comparison --out "$OUT" "$@"
[ -n "${profiler:-}" ] && wait "$profiler"
exit $status

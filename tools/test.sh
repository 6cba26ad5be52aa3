#!/usr/bin/env bash
# `make test`: the linters, the type check and the whole suite, in two pytest processes side
# by side.
#
# In one process the suite used about 1.1 of the 2 cores: the server tests wait on processes and
# sockets, the kernel tests run Triton's interpreter on one core. So the modules that start
# servers, Ray clusters or worker processes (marker `processes`, tests/conftest.py) run one
# after another in one lane, every other module in a second lane; the linters (32 s of one core)
# run in the first lane's slot after its tests, since the second lane ends about 2 minutes later
# and linters started beside both slowed both. Each lane's torch takes one thread
# (OMP_NUM_THREADS=1, inherited by the servers it starts, as Ray gives a one-CPU actor): two
# processes with two OpenMP threads each spin-wait on each other's cores. (pytest-xdist was
# tried: --dist loadfile ran two deployments side by side, whose restart and heartbeat waits
# stretched, 12m12s against 12m57s in one process; its loadgroup does not group under pytest
# 9.2.) The second lane's and the linters' output follows the first's. Extra arguments go to
# both lanes (e.g. -x, -k, a file: a lane left with no test counts as passed); PYTEST_ADDOPTS
# reaches them too.
#
# Every Python process of the suite (the lanes, each server, each Ray worker and agent, each
# restarted worker) imports torch, Ray and the rest: about 3,500 modules. `make install` writes
# no bytecode for them (pip --no-compile), and where PYTHONDONTWRITEBYTECODE is set (this
# VM's environment sets it) each process compiled them all from source again. Their
# bytecode goes to one folder in the venv instead (PYTHONPYCACHEPREFIX, inherited by every
# process the suite starts; no __pycache__ in the source tree): compiled by the first process
# that imports a module, read by every later one. test_api_errors (one deployment) took 73 s
# against 154-173 s without it, twice each, alternating, at a load of 12-15.
set -u
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
venv_dir=$(cd "$VENV" && pwd) || exit 1
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-$venv_dir/pycache}
unset PYTHONDONTWRITEBYTECODE
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

"$VENV/bin/pytest" -q -ra -p no:cacheprovider --basetemp="$logs/tmp" -m "not processes" "$@" \
    >"$logs/lane" 2>&1 &
lane_pid=$!
"$VENV/bin/pytest" -q -ra -m processes "$@"
processes_rc=$?
make --no-print-directory lint VENV="$VENV" >"$logs/lint" 2>&1
lint_rc=$?
wait "$lane_pid"
lane_rc=$?
echo "--- beside it: every other module ---"
cat "$logs/lane"
echo "--- beside it: ruff, mypy, check_layout ---"
cat "$logs/lint"
ok() { [ "$1" -eq 0 ] || [ "$1" -eq 5 ]; }  # 5: no test selected in that lane
if ! ok "$processes_rc" || ! ok "$lane_rc" || [ "$lint_rc" -ne 0 ]; then
    echo "make test: FAILED (process modules exit $processes_rc, other modules exit $lane_rc, linters exit $lint_rc)"
    exit 1
fi

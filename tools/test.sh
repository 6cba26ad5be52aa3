#!/usr/bin/env bash
# `make test`: the linters, the type check and the whole suite.
#
# The suite runs in two pytest-xdist workers, a test module at a time on one worker
# (--dist loadgroup, a group per module, so a module's fixtures, e.g. its server, are built
# once); the modules that start servers and Ray clusters are one group, run one after another
# (tests/conftest.py). In one process it
# used about 1.1 of the 2 cores: the server tests wait on processes and sockets, the kernel
# tests run Triton's interpreter on one core. Each worker's torch takes one thread
# (OMP_NUM_THREADS=1, inherited by the servers it starts, as Ray gives a one-CPU actor): two
# workers with two OpenMP threads each spin-waited on each other's cores and the suite took
# 17 minutes instead of 13. The linters (single-threaded) run beside it; their output follows
# the suite's. Session fixtures (the default deployment, the offline SmolLM2 engine) are built
# once per worker. Extra arguments go to pytest (e.g. -x, -k); PYTEST_ADDOPTS reaches it too;
# SPLITSERVE_TEST_WORKERS=0 runs it in one process with torch's own thread count.
set -u
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
WORKERS=${SPLITSERVE_TEST_WORKERS:-2}
lint_log=$(mktemp)
trap 'rm -f "$lint_log"' EXIT

make --no-print-directory lint VENV="$VENV" >"$lint_log" 2>&1 &
lint_pid=$!
if [ "$WORKERS" -gt 0 ]; then
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$VENV/bin/pytest" -q -ra -n "$WORKERS" --dist loadgroup "$@"
else
    "$VENV/bin/pytest" -q -ra "$@"
fi
main_rc=$?
wait "$lint_pid"
lint_rc=$?
echo "--- beside the suite: ruff, mypy, check_layout ---"
cat "$lint_log"
if [ "$main_rc" -ne 0 ] || [ "$lint_rc" -ne 0 ]; then
    echo "make test: FAILED (pytest exit $main_rc, linters exit $lint_rc)"
    exit 1
fi

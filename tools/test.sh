#!/usr/bin/env bash
# `make test`: the linters, the type check and the whole suite, in two processes side by side.
#
# The kernel tests run Triton's interpreter (pure Python, one core) and the linters are
# single-threaded too; the rest of the suite (engines, Ray workers, servers) leaves about a
# third of the two cores idle while it waits on processes and sockets. So the linters and
# tests/kernels run beside the rest instead of before it; their output follows the main run's.
# Extra arguments go to the main pytest run (e.g. -x, -k); PYTEST_ADDOPTS reaches both.
set -u
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
side_log=$(mktemp)
side_tmp=$(mktemp -d)
trap 'rm -rf "$side_log" "$side_tmp"' EXIT

side() {
    local rc=0
    make --no-print-directory lint VENV="$VENV" || rc=1
    "$VENV/bin/pytest" -q -ra -p no:cacheprovider --basetemp="$side_tmp" tests/kernels || rc=1
    return $rc
}

side >"$side_log" 2>&1 &
side_pid=$!
"$VENV/bin/pytest" -q -ra --ignore=tests/kernels "$@"
main_rc=$?
wait "$side_pid"
side_rc=$?
echo "--- beside the main run: ruff, mypy, check_layout, tests/kernels ---"
cat "$side_log"
if [ "$main_rc" -ne 0 ] || [ "$side_rc" -ne 0 ]; then
    echo "make test: FAILED (main run exit $main_rc, linters and kernel tests exit $side_rc)"
    exit 1
fi

#!/usr/bin/env bash
# The AVX-512 block products (blocks_avx512.c, blocks_interleaved.c) tested on a CPU without
# AVX-512: builds the native kernels with those two files' intrinsics emulated by SIMDe
# (shim.h; `apt-get install libsimde-dev`) and their AVX-512 code compiled for AVX2, then runs
# pytest with that library in place of the real build (plugin.py), so the tests that need
# AVX-512F run instead of skipping. It checks the code's logic, not its speed.
#   bash tools/emulated_avx512/run.sh                  # the block product tests
#   bash tools/emulated_avx512/run.sh tests/x.py -k y  # others
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-.venv/bin}
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
cp splitserve/kernels/native/*.c splitserve/kernels/native/*.h tools/emulated_avx512/shim.h "$build"
for f in blocks_avx512.c blocks_interleaved.c; do
    sed -i -e 's/target("avx512f,fma,f16c")/target("avx2,fma,f16c")/' \
        -e 's/__builtin_cpu_supports("avx512f")/1/' \
        -e 's/#include <immintrin.h>/#include "shim.h"/' "$build/$f"
done
(cd "$build" && cc -O2 -fPIC -shared -fopenmp -fno-math-errno -ffp-contract=off \
    -o libemulated.so blocks.c blocks_avx2.c blocks_avx512.c blocks_interleaved.c decode.c \
    prefill.c -lm)
if [ $# -eq 0 ]; then
    set -- tests/test_native_kquants.py tests/test_native_kernels.py -k "avx512 or interleaved or block_matmul"
fi
SPLITSERVE_EMULATED_LIBRARY="$build/libemulated.so" PYTHONPATH="$PWD:$PWD/tools/emulated_avx512" \
    "$BIN/python" -m pytest -q -p emulated_library "$@"

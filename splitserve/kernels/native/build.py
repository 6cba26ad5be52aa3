"""The native CPU kernels: C sources beside this file, compiled once by the system's C compiler.

The shared library lands in ``$XDG_CACHE_HOME/splitserve/native/<key>/`` (default
``~/.cache``), keyed by the source, the flags and the compiler's version, so an edit or another
compiler builds anew and every process after the first only loads it (a build takes about a
second). A build goes to a temporary name and is renamed into place, so processes starting
together never load a half-written file. Without a compiler, or where the build fails, the
library is absent (``load()`` returns None, the reason logged once) and the engine keeps its
torch paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = (
    "blocks.c",
    "blocks_avx2.c",
    "blocks_avx512.c",
    "blocks_interleaved.c",
    "blocks_row16.c",
    "blocks_row16_avx2.c",
    "decode.c",
    "decode_rows.c",
    "prefill.c",
)
HEADERS = ("attend.h", "blocks.h", "vec16.h")
FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno", "-ffp-contract=off")
LIBRARY = "libsplitserve_native.so"


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "splitserve" / "native"


def _compiler() -> str | None:
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _build_key(compiler: str) -> str:
    digest = hashlib.sha256()
    here = Path(__file__).parent
    for source in SOURCES + HEADERS:
        digest.update((here / source).read_bytes())
    digest.update(" ".join(FLAGS).encode())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False)
    digest.update(version.stdout.encode())
    return digest.hexdigest()[:16]


def build(root: Path | None = None) -> Path:
    """The compiled library's path, building it if this source has not been built yet.

    Raises RuntimeError with the compiler's message when there is no compiler or it fails."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    folder = (root or cache_root()) / _build_key(compiler)
    target = folder / LIBRARY
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    sources = [str(Path(__file__).parent / s) for s in SOURCES]
    with tempfile.NamedTemporaryFile(dir=folder, suffix=".so", delete=False) as tmp:
        partial = tmp.name
    done = subprocess.run(
        [compiler, *FLAGS, "-o", partial, *sources, "-lm"], capture_output=True, text=True
    )
    if done.returncode != 0:
        os.unlink(partial)
        raise RuntimeError(f"building the native kernels failed: {done.stderr.strip()[-2000:]}")
    os.replace(partial, target)
    return target


@cache
def load() -> ctypes.CDLL | None:
    """The native kernels, built if needed; None (logged once) where they cannot be built."""
    try:
        lib = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as error:
        log.warning("native CPU kernels unavailable, using the torch paths: %s", error)
        return None
    _declare(lib)
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.splitserve_block_matmul.argtypes = [i32, i32, ptr, i64, i64, ptr, ptr, i64, ptr]
    lib.splitserve_block_matmul.restype = i32
    lib.splitserve_interleaved_bytes.argtypes = [i32, i64, i64]
    lib.splitserve_interleaved_bytes.restype = i64
    lib.splitserve_interleave.argtypes = [i32, ptr, i64, i64, ptr]
    lib.splitserve_interleave.restype = None
    lib.splitserve_dequant_rows.argtypes = [i32, ptr, i64, ptr, i64, ptr]
    lib.splitserve_dequant_rows.restype = None
    lib.splitserve_block_bytes.argtypes = [i32]
    lib.splitserve_block_bytes.restype = i32
    lib.splitserve_has_avx512bw.argtypes = []
    lib.splitserve_has_avx512bw.restype = i32
    lib.splitserve_best_isa.argtypes = []
    lib.splitserve_best_isa.restype = i32
    f32 = ctypes.c_float
    lib.splitserve_add_rms_norm.argtypes = [ptr, ptr, ptr, f32, i64, i64, ptr, ptr]
    lib.splitserve_add_rms_norm.restype = None
    lib.splitserve_silu_and_mul.argtypes = [ptr, i64, i64, ptr]
    lib.splitserve_silu_and_mul.restype = None
    lib.splitserve_gelu_tanh_and_mul.argtypes = [ptr, i64, i64, ptr]
    lib.splitserve_gelu_tanh_and_mul.restype = None
    # qkv, B, H, Hkv, D, positions, cos, sin, k_cache, v_cache, block_size, slots,
    # block_tables, max_blocks, context_lens, scale, window, out
    lib.splitserve_decode_attention.argtypes = [
        *(ptr, i64, i32, i32, i32, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, ptr),
        *(f32, i64, ptr),
    ]
    lib.splitserve_decode_attention.restype = i32
    # x, residual, B, layers, ints, types, dims, groups, eps, scale, positions, scratch, isa
    lib.splitserve_decode_layers.argtypes = [
        *(ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, f32, f32, ptr, ptr, i32)
    ]
    lib.splitserve_decode_layers.restype = i32
    # q, k, v, L, T, H, Hkv, D, scale, out
    lib.splitserve_prefill_attention.argtypes = [ptr, ptr, ptr, i64, i64, i32, i32, i32, f32, ptr]
    lib.splitserve_prefill_attention.restype = i32

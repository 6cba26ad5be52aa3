"""pytest plugin of tools/emulated_avx512/run.sh: the native kernels come from the library
named by SPLITSERVE_EMULATED_LIBRARY (AVX-512 emulated) instead of the package's build."""

from __future__ import annotations

import ctypes
import os

from splitserve.engine.layers import native_decode
from splitserve.kernels.native import blocks, build, decode

_library = ctypes.CDLL(os.environ["SPLITSERVE_EMULATED_LIBRARY"])
build._declare(_library)
for _module in (build, blocks, decode, native_decode):
    _module.load = lambda: _library  # type: ignore[attr-defined]

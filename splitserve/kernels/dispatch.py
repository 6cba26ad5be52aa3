"""When the model's layers take the Triton kernels instead of their torch code.

The kernels run on CUDA tensors when Triton is installed; CPU tensors do not take them (they
take the native CPU kernels of ``kernels/native/`` where those are built, else torch).
``set_kernels_enabled(False)`` turns the kernels off (for A/B benchmarks and for debugging);
``set_kernels_on_cpu(True)`` sends CPU tensors through them too, which under
``TRITON_INTERPRET=1`` is how the tests run the whole model on the kernels without a GPU.
"""

from __future__ import annotations

import importlib.util
from functools import cache

import torch

_enabled = True
_on_cpu = False
_decode_path = "fused"
DECODE_PATHS = ("fused", "gemv", "separate")


@cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def set_kernels_enabled(enabled: bool) -> None:
    global _enabled
    _enabled = enabled


def set_kernels_on_cpu(on_cpu: bool) -> None:
    global _on_cpu
    _on_cpu = on_cpu


def set_decode_path(path: str) -> None:
    """How a one-row step runs its projections (``engine/layers/linear.py``): "fused" (the GEMV
    kernel with the RMSNorm before it and the SiLU after it folded in), "gemv" (the GEMV
    kernel with SiLU; RMSNorm as its own kernel) or "separate" (cuBLAS and separate kernels,
    as at larger batches). For A/B benchmarks."""
    global _decode_path
    if path not in DECODE_PATHS:
        raise ValueError(f"decode path must be one of {DECODE_PATHS}, not {path!r}")
    _decode_path = path


def decode_path() -> str:
    return _decode_path


def use_kernels(x: torch.Tensor) -> bool:
    """True when ``x`` should go through the Triton kernels."""
    return (x.is_cuda or _on_cpu) and _enabled and triton_available()


@cache
def num_sms(device: torch.device) -> int | None:
    """The GPU's multiprocessor count; None off CUDA."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device).multi_processor_count)

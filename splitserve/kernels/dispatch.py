"""When the model's layers take the Triton kernels instead of their torch code.

The kernels run on CUDA tensors when Triton is installed; CPU tensors always keep the torch
code, so CPU outputs stay bit-for-bit those of the references. ``set_kernels_enabled(False)``
turns the kernels off (for A/B benchmarks and for debugging).
"""

from __future__ import annotations

import importlib.util
from functools import cache

import torch

_enabled = True


@cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def set_kernels_enabled(enabled: bool) -> None:
    global _enabled
    _enabled = enabled


def use_kernels(x: torch.Tensor) -> bool:
    """True when ``x`` should go through the Triton kernels."""
    return x.is_cuda and _enabled and triton_available()

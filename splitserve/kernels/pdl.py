"""Programmatic dependent launch (PDL) for the decode-step kernels, on Hopper and newer GPUs.

A decode step at batch 1 is a chain of a few hundred short kernels; without PDL each one
starts only when the one before it has finished and drained, so every boundary costs the
launch latency plus the ramp-down and ramp-up of two kernels. With PDL a kernel launched with
``launch_pdl=True`` may start once every program of the kernel before it has started (each
program calls ``launch_dependents`` first thing). It then does the work that needs nothing
from that kernel (the GEMV streams in its first weight tile) and calls ``wait``, which returns
once the kernel before it has completed and its writes are visible.

The rule that keeps this correct: every kernel launched with PDL calls ``wait`` in every
program, before any read of an activation and before any write. Kernels reached from CPU
tensors (the interpreter) and GPUs older than Hopper launch as usual (``PDL=False`` compiles
both calls away); ``set_pdl_enabled(False)`` turns PDL off for A/B benchmarks.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAS_GDC = True
except ImportError:  # Triton before 3.4
    _HAS_GDC = False

_enabled = True


def set_pdl_enabled(enabled: bool) -> None:
    global _enabled
    _enabled = enabled


@cache
def _supported(device: torch.device) -> bool:
    return _HAS_GDC and torch.cuda.get_device_capability(device)[0] >= 9


def use_pdl(x: torch.Tensor) -> bool:
    """True when kernels on x's device should launch with PDL."""
    return _enabled and x.is_cuda and _supported(x.device)


def launch_kwargs(x: torch.Tensor) -> dict[str, bool]:
    """The kernel arguments that turn PDL on or off for a launch on x's device."""
    on = use_pdl(x)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Lets the next kernel launch once every program of this one has called this."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Blocks until the kernel before this one has completed and its writes are visible."""
    if PDL:
        gdc_wait()

"""Which product each CPU projection takes, chosen by measuring the candidates at load.

No fixed rule holds across CPUs: on one AMD EPYC VM oneDNN's packed float32 GEMM ran 2x
MKL's (``F.linear``); on an Intel Xeon VM it was slower at one row. So each distinct
projection shape is timed once when the model loads, at a few row counts, and every module of
that shape takes the faster product at each count:

- a block-quantized weight (``BlockLinear``): the native kernel, or dequantizing the whole
  weight and taking torch's GEMM (which can win on long prefill chunks);
- a float32 weight (``nn.Linear``): oneDNN on its packed copy, or ``F.linear``. A layer that
  never takes oneDNN drops its packed copy (it doubled the weights' memory).

A row count between two measured ones takes the choice of the smaller; row counts whose
product would cost more than ``MAX_FLOPS`` are not timed (the lm_head at 128 rows) and take the
choice of the largest timed one. The choices go to the log, one line per shape.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.layers.block_linear import BlockLinear
from splitserve.engine.layers.cpu_gemm import onednn_linear, set_onednn_max_rows
from splitserve.kernels.native.blocks import NAMES, block_matmul

log = logging.getLogger(__name__)

ROWS = (1, 16, 128)
MAX_FLOPS = 1e9
REPEATS = 2


@dataclass(frozen=True)
class Choice:
    shape: str
    """e.g. "Q4_1 3072x576" or "f32 576x576"."""
    micros: dict[int, dict[str, float]]
    """rows -> candidate -> microseconds per call (the best of REPEATS)."""
    first_max_rows: int | None
    """The first candidate serves up to this many rows (None: every count)."""
    modules: int


def choose_cpu_paths(model: nn.Module) -> list[Choice]:
    """Measures each distinct CPU projection shape of the model and sets its modules' choice."""
    groups: dict[tuple[object, ...], list[nn.Module]] = {}
    for module in model.modules():
        key = _shape_key(module)
        if key is not None:
            groups.setdefault(key, []).append(module)
    choices = [_choose(modules) for modules in groups.values()]
    for c in choices:
        timings = "; ".join(
            f"{rows} rows " + ", ".join(f"{name} {us:.0f} us" for name, us in cands.items())
            for rows, cands in c.micros.items()
        )
        limit = "all rows" if c.first_max_rows is None else f"<= {c.first_max_rows} rows"
        log.info(
            "projection %s (x%d): first candidate for %s (%s)", c.shape, c.modules, limit, timings
        )
    return choices


def _shape_key(module: nn.Module) -> tuple[object, ...] | None:
    if isinstance(module, BlockLinear):
        return ("blocks", module.qtype, module.out_features, module.in_features)
    if (
        type(module) is nn.Linear
        and module.weight.device.type == "cpu"
        and module.weight.dtype == torch.float32
    ):
        return ("f32", module.out_features, module.in_features, module.bias is not None)
    return None


def _choose(modules: list[nn.Module]) -> Choice:
    first = modules[0]
    candidates = _candidates(first)
    micros: dict[int, dict[str, float]] = {}
    for rows in ROWS:
        if rows > 1 and 2 * rows * _numel(first) > MAX_FLOPS:
            break
        x = torch.randn(rows, _in_features(first))
        micros[rows] = {name: _time(fn, x) for name, fn in candidates.items()}
    limit = first_max_rows(micros, next(iter(candidates)))
    for module in modules:
        if isinstance(module, BlockLinear):
            module.native_max_rows = limit
        elif isinstance(module, nn.Linear):
            set_onednn_max_rows(module, limit)
    return Choice(_describe(first), micros, limit, len(modules))


Candidate = Callable[[torch.Tensor], "torch.Tensor | None"]


def _candidates(module: nn.Module) -> dict[str, Candidate]:
    if isinstance(module, BlockLinear):
        return {
            "native": lambda x: block_matmul(x, module.weight, module.qtype),
            "dequantize+gemm": lambda x: F.linear(x, module.dequantized()),
        }
    assert isinstance(module, nn.Linear)
    cands: dict[str, Candidate] = {}
    if onednn_linear(torch.zeros(1, module.in_features), module) is not None:
        cands["onednn"] = lambda x: onednn_linear(x, module)
    cands["F.linear"] = lambda x: F.linear(x, module.weight, module.bias)
    return cands


def first_max_rows(micros: dict[int, dict[str, float]], first: str) -> int | None:
    """The largest measured row count up to which the first candidate always won."""
    best_up_to: int | None = 0
    for rows, cands in micros.items():
        if min(cands, key=cands.__getitem__) != first:
            return best_up_to
        best_up_to = rows
    return None


@torch.no_grad()
def _time(fn: Candidate, x: torch.Tensor) -> float:
    fn(x)
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def _numel(module: nn.Module) -> int:
    return _in_features(module) * int(module.out_features)  # type: ignore[arg-type]


def _in_features(module: nn.Module) -> int:
    return int(module.in_features)  # type: ignore[arg-type]


def _describe(module: nn.Module) -> str:
    kind = NAMES[module.qtype] if isinstance(module, BlockLinear) else "f32"
    return f"{kind} {module.out_features}x{module.in_features}"

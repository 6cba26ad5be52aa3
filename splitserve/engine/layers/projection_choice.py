"""Which product each CPU projection takes, chosen by measuring the candidates at load.

No fixed rule holds across CPUs: on one AMD EPYC VM oneDNN's packed float32 GEMM ran 2x
MKL's (``F.linear``); on an Intel Xeon VM it was slower at one row. So each distinct
projection shape is timed once when the model loads, at a few row counts, and every module of
that shape takes the faster product at each count:

- a block-quantized weight (``BlockLinear``): the native kernel, or dequantizing the whole
  weight and taking a float32 GEMM, oneDNN's where torch has it (which wins on long prefill
  chunks: SmolLM2's projections from 128 rows on one AMD EPYC thread);
- a float32 weight (``nn.Linear``): oneDNN on its packed copy, or ``F.linear``. A layer that
  never takes oneDNN drops its packed copy (it doubled the weights' memory).

A row count between two measured ones takes the choice of the smaller; row counts whose
product would cost more than ``MAX_FLOPS`` are not timed (SmolLM2's lm_head past one row) and
take the choice of the largest timed one. Each candidate is timed on one thread, in the CPU
time of that thread (the best of ``REPEATS``): processes sharing the cores (a prefill and a
decode worker on one machine, a test suite) made wall-clock choices noise, e.g. oneDNN at 13 ms
against 85 us for one 576x576 row while the other core was busy. The choices go to the log,
one line per shape.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.layers.batch_invariant import make_batch_invariant
from splitserve.engine.layers.block_linear import BlockLinear
from splitserve.engine.layers.cpu_gemm import dense_gemm, onednn_linear, set_onednn_choice
from splitserve.kernels.native.blocks import NAMES, block_matmul

log = logging.getLogger(__name__)

ROWS = (1, 16, 128)
NATIVE, DEQUANTIZE, ONEDNN, F_LINEAR = "native", "dequantize+gemm", "onednn", "F.linear"
MAX_FLOPS = 5e8
REPEATS = 3


@dataclass(frozen=True)
class Choice:
    shape: str
    """e.g. "Q4_1 3072x576" or "f32 576x576"."""
    micros: dict[int, dict[str, float]]
    """rows -> candidate -> microseconds per call (the best of REPEATS)."""
    table: tuple[tuple[int, str], ...]
    """(rows, the faster candidate there), by rows; see ``pick``."""
    modules: int


def pick(table: tuple[tuple[int, str], ...], rows: int) -> str:
    """The candidate chosen for the largest measured row count not above rows (the smallest
    one's below it)."""
    chosen = table[0][1]
    for measured, name in table:
        if measured > rows:
            break
        chosen = name
    return chosen


def choose_cpu_paths(model: nn.Module, invariant: bool = False) -> list[Choice]:
    """Measures each distinct CPU projection shape of the model and sets its modules' choice;
    invariant (deterministic mode): measures nothing and gives every projection its
    batch-invariant product instead (``batch_invariant.py``)."""
    if invariant:
        make_batch_invariant(model)
        return []
    groups: dict[tuple[object, ...], list[nn.Module]] = {}
    for module in model.modules():
        key = _shape_key(module)
        if key is not None:
            groups.setdefault(key, []).append(module)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        choices = [_choose(modules) for modules in groups.values()]
    finally:
        torch.set_num_threads(threads)
    for c in choices:
        timings = "; ".join(
            f"{rows} rows " + ", ".join(f"{name} {us:.0f} us" for name, us in cands.items())
            for rows, cands in c.micros.items()
        )
        chosen = ", ".join(f"from {rows} rows {name}" for rows, name in c.table)
        log.info("projection %s (x%d): %s (%s)", c.shape, c.modules, chosen, timings)
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
        micros[rows] = {
            name: _time(fn, x) for name, fn in candidates.items() if _worth_timing(name, rows)
        }
    table = tuple((rows, min(c, key=c.__getitem__)) for rows, c in micros.items())
    for module in modules:
        if isinstance(module, BlockLinear):
            module.dequantize_from = _first_rows(table, DEQUANTIZE)
        elif isinstance(module, nn.Linear):
            ever = any(name == ONEDNN for _, name in table)
            set_onednn_choice(module, partial(_takes, table), ever)
    return Choice(_describe(first), micros, table, len(modules))


def _takes(table: tuple[tuple[int, str], ...], rows: int) -> bool:
    return pick(table, rows) == ONEDNN


def _worth_timing(name: str, rows: int) -> bool:
    """At one row dequantizing the whole weight is the native kernel's work and more."""
    return not (name == DEQUANTIZE and rows == 1)


def _first_rows(table: tuple[tuple[int, str], ...], name: str) -> int | None:
    """The smallest measured row count from which name is chosen for good (None: never)."""
    first = None
    for rows, chosen in table:
        first = (first or rows) if chosen == name else None
    return first


Candidate = Callable[[torch.Tensor], "torch.Tensor | None"]


def _candidates(module: nn.Module) -> dict[str, Candidate]:
    if isinstance(module, BlockLinear):
        return {
            NATIVE: lambda x: block_matmul(
                x, module.weight, module.qtype, interleaved=module.interleaved
            ),
            DEQUANTIZE: lambda x: dense_gemm(x, module.dequantized()),
        }
    assert isinstance(module, nn.Linear)
    cands: dict[str, Candidate] = {}
    if onednn_linear(torch.zeros(1, module.in_features), module) is not None:
        cands[ONEDNN] = lambda x: onednn_linear(x, module, force=True)
    cands[F_LINEAR] = lambda x: F.linear(x, module.weight, module.bias)
    return cands


@torch.no_grad()
def _time(fn: Candidate, x: torch.Tensor) -> float:
    fn(x)
    best = float("inf")
    for _ in range(REPEATS):
        start = time.thread_time()
        fn(x)
        best = min(best, time.thread_time() - start)
    return best * 1e6


def _numel(module: nn.Module) -> int:
    return _in_features(module) * int(module.out_features)  # type: ignore[arg-type]


def _in_features(module: nn.Module) -> int:
    return int(module.in_features)  # type: ignore[arg-type]


def _describe(module: nn.Module) -> str:
    kind = NAMES[module.qtype] if isinstance(module, BlockLinear) else "f32"
    return f"{kind} {module.out_features}x{module.in_features}"

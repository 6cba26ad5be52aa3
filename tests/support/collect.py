"""Freeing the engines that tests dropped: an engine is a reference cycle (its KV handoff and
prefix cache point back at it), freed only by the cyclic collector, which counts Python
objects, not bytes: a few dozen dropped engines (each about 2 GB of weights, packed weights
and KV on the CPU) once outgrew the 24 GB machine. So the suite collects at the end of each
module and before each SmolLM2 engine it builds (tests/conftest.py), where the process has
grown by GROWTH_BYTES since the last collection: a full collection walks the 240,000 objects
that the session made after its collection phase (0.1 s; 11 s over the modules of a lane,
most of which dropped no engine, or a tiny one of some 30 MB)."""

from __future__ import annotations

import gc
import os

GROWTH_BYTES = 256 << 20
_after_last = [0]
"""The resident bytes after the last collection."""


def collect_dropped_engines() -> None:
    if resident_bytes() - _after_last[0] < GROWTH_BYTES:
        return
    gc.collect()
    _after_last[0] = resident_bytes()


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

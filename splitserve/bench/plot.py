"""Latency against throughput for a rate sweep, one panel per latency metric."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

_PANELS = (("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"), ("e2el", "E2E latency (ms)"))


def plot_sweep(runs: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    """Median and p99 of each latency against achieved output throughput, points labelled
    with the offered request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(_PANELS), figsize=(5 * len(_PANELS), 4), squeeze=False)
    throughput = [run["output_throughput"] for run in runs]
    for ax, (name, label) in zip(axes[0], _PANELS, strict=True):
        for stat, style in (("median", "o-"), ("p99", "s--")):
            values = [run.get(f"{stat}_{name}_ms") for run in runs]
            points = [(x, y) for x, y in zip(throughput, values, strict=True) if y is not None]
            if points:
                ax.plot(*zip(*points, strict=True), style, label=stat)
        for run, x in zip(runs, throughput, strict=True):
            y = run.get(f"median_{name}_ms")
            if y is not None:
                ax.annotate(f"{run['request_rate']:g}/s", (x, y), fontsize=7)
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""Render the Grafana dashboard's panels to one PNG from a Prometheus server's data.

No Grafana server is needed: each panel's PromQL expressions go through Prometheus's
`query_range` API and are plotted with matplotlib, one subplot per panel, one line per series
(named by the target's legendFormat).

    python benchmarks/render_dashboard.py --prometheus http://127.0.0.1:9090 \
        --minutes 5 --out docs/img/dashboard.png
"""

from __future__ import annotations

import argparse
import json
import re
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "deploy" / "grafana" / "splitserve.json"
RATE_INTERVAL = "30s"
UNIT_SCALE = {"s": (1.0, "seconds"), "percentunit": (100.0, "%"), "Bps": (1e-6, "MB/s")}


def dashboard_exprs(path: Path = DASHBOARD) -> list[tuple[str, str, str]]:
    """(panel title, PromQL, legendFormat) of every target, with Grafana's variables
    replaced by what a plain Prometheus query needs."""
    panels = json.loads(path.read_text())["panels"]
    return [
        (panel["title"], promql(target["expr"]), target.get("legendFormat", ""))
        for panel in panels
        for target in panel["targets"]
    ]


def promql(expr: str, rate_interval: str = RATE_INTERVAL) -> str:
    return expr.replace("$__rate_interval", rate_interval).replace("$model", ".*")


def query_range(url: str, expr: str, start: float, end: float, step: float) -> list[Any]:
    params = {"query": expr, "start": start, "end": end, "step": step}
    body = httpx.get(f"{url}/api/v1/query_range", params=params, timeout=60).json()
    if body["status"] != "success":
        raise RuntimeError(f"{expr}: {body}")
    result: list[Any] = body["data"]["result"]
    return result


def legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()


def render(url: str, start: float, end: float, out: Path, step: float = 2.0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = json.loads(DASHBOARD.read_text())["panels"]
    rows = -(-len(panels) // 2)
    fig, axes = plt.subplots(rows, 2, figsize=(13, 2.9 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        scale, unit = UNIT_SCALE.get(panel["fieldConfig"]["defaults"]["unit"], (1.0, ""))
        for target in panel["targets"]:
            for series in query_range(url, promql(target["expr"]), start, end, step):
                points = [(float(t) - start, float(v) * scale) for t, v in series["values"]]
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, label=legend(target["legendFormat"], series["metric"]))
        ax.set_title(panel["title"], fontsize=10)
        ax.set_ylabel(unit, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=6, loc="upper left", ncol=2)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    stamp = datetime.fromtimestamp(start).strftime("%Y-%m-%d %H:%M:%S")
    fig.suptitle(f"splitserve dashboard (seconds since {stamp})", fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=72)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--minutes", type=float, default=15.0, help="how far back to plot")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img" / "dashboard.png")
    args = parser.parse_args()
    end = time.time()
    render(args.prometheus, end - 60 * args.minutes, end, args.out)


if __name__ == "__main__":
    main()

"""The summary table printed after a run and the JSON record written to ``--result-file``."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from splitserve.bench.client import RequestResult

_COUNTS = (
    ("Successful requests", "completed"),
    ("Failed requests", "failed"),
    ("Benchmark duration (s)", "duration"),
    ("Total input tokens", "total_input_tokens"),
    ("Total generated tokens", "total_output_tokens"),
    ("Request throughput (req/s)", "request_throughput"),
    ("Goodput (req/s)", "goodput"),
    ("Output token throughput (tok/s)", "output_throughput"),
    ("Total token throughput (tok/s)", "total_token_throughput"),
)
_SECTIONS = (
    ("Time to first token", "ttft"),
    ("Time per output token (excl. 1st)", "tpot"),
    ("Inter-token latency", "itl"),
    ("End-to-end latency", "e2el"),
)


def git_commit() -> str | None:
    """The commit the harness runs from: SPLITSERVE_GIT_COMMIT when set (a copied tree on a
    GPU machine can carry stale git metadata, so the launching script names the commit), else
    the checkout's HEAD, else None."""
    if os.environ.get("SPLITSERVE_GIT_COMMIT"):
        return os.environ["SPLITSERVE_GIT_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def format_table(summary: dict[str, Any], title: str) -> str:
    """A fixed-width table of the summary, followed by the error messages if any."""
    lines = [f"{f' {title} ':=^60}"]
    lines += [_row(label, summary.get(key)) for label, key in _COUNTS]
    for heading, name in _SECTIONS:
        lines.append(f"{f' {heading} ':-^60}")
        for key in (k for k in summary if k.endswith(f"_{name}_ms")):
            stat = key.split("_")[0]
            lines.append(_row(f"{stat.capitalize()} {name.upper()} (ms)", summary[key]))
    for message, count in summary.get("errors", {}).items():
        lines.append(f"error x{count}: {message}")
    lines.append("=" * 60)
    return "\n".join(lines)


def _row(label: str, value: Any) -> str:
    if value is None:
        shown = "n/a"
    elif isinstance(value, float):
        shown = f"{value:.2f}"
    else:
        shown = str(value)
    return f"{label:<44}{shown:>16}"


def details(results: Sequence[RequestResult]) -> dict[str, list[Any]]:
    """Per-request values as parallel lists (seconds), in send order."""
    return {
        "start_times": [r.start for r in results],
        "input_lens": [r.prompt_tokens for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft if r.success else None for r in results],
        "itls": [list(r.itls) for r in results],
        "e2els": [r.e2el for r in results],
        "errors": [r.error for r in results],
    }


def header(config: dict[str, Any]) -> dict[str, Any]:
    """What every result file starts with: when, from which commit, with which flags."""
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git_commit": git_commit(),
        "model_id": config.get("model"),
        "config": config,
    }


def emit(report: dict[str, Any], out: Path | None) -> None:
    """Print the report as one JSON line, the last of the run, and write it to ``out``."""
    line = json.dumps(report)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(line + "\n")
    print(line)

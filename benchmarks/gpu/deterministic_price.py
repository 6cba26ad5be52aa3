"""The price of deterministic mode from two ``splitserve bench offline`` results of one run (the
default mode's, then ``--deterministic``'s): decode tok/s per batch size and prefill tok/s,
with deterministic over default (issue 45's goal: at least 0.85x everywhere). Prints one JSON
object (also to $OUT/deterministic-price.json).

    python -m benchmarks.gpu.deterministic_price DEFAULT.json DETERMINISTIC.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def rates(result: dict[str, Any]) -> dict[str, float]:
    """{"decode_b<batch>": tok/s, ..., "prefill_<len>": tok/s} of one bench offline result."""
    out = {
        f"decode_b{row['batch']}": row["splitserve"]["decode_tokens_per_s"]
        for row in result["decode"]
    }
    if "prefill" in result:
        out["prefill"] = result["prefill"]["prefill_tokens_per_s"]
    return out


def main() -> int:
    default, deterministic = (json.loads(Path(p).read_text()) for p in sys.argv[1:3])
    base, ours = rates(default), rates(deterministic)
    report = {
        "model": deterministic.get("model_id"),
        "device": deterministic.get("device_name"),
        "default_tokens_per_s": base,
        "deterministic_tokens_per_s": ours,
        "deterministic_over_default": {case: ours[case] / base[case] for case in base},
    }
    text = json.dumps(report, indent=1)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "deterministic-price.json").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

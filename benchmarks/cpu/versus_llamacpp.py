"""Puts `splitserve bench offline` results beside llama.cpp's batch-1 decode on the same GGUF
file (benchmarks/cpu/run.sh runs all of them in one go) and checks the targets: batch 1 at least
llama.cpp's batch 1 (issues 23 and 43), batch 32 at least 5x it (issue 23, SmolLM2; Gemma's
batch 32 is reported). Writes cpu-versus-llamacpp.json (--out: another name) beside its inputs
and prints a table.

python -m benchmarks.cpu.versus_llamacpp OURS LLAMACPP [FLOAT32 [BF16]] [--out NAME]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def decode_rates(result: dict[str, Any]) -> dict[int, float]:
    return {row["batch"]: row["splitserve"]["decode_tokens_per_s"] for row in result["decode"]}


def main(
    ours_path: str,
    llamacpp_path: str,
    float32_path: str | None = None,
    bf16_path: str | None = None,
    out_name: str = "cpu-versus-llamacpp.json",
) -> None:
    """bf16_path: the opt-in bfloat16 weights (``--cpu-weights bfloat16``), reported beside
    the default mode; the targets are checked on the default mode."""
    ours = json.loads(Path(ours_path).read_text())
    llamacpp = json.loads(Path(llamacpp_path).read_text())
    base = llamacpp["decode_tokens_per_s"]
    rates = decode_rates(ours)
    transformers = {
        row["batch"]: row["transformers"]["decode_tokens_per_s"]
        for row in ours["decode"]
        if "transformers" in row
    }
    before = decode_rates(json.loads(Path(float32_path).read_text())) if float32_path else {}
    bf16 = decode_rates(json.loads(Path(bf16_path).read_text())) if bf16_path else {}
    summary = {
        "git_commit": ours.get("git_commit"),
        "machine": ours.get("device_name"),
        "llamacpp_batch1_tokens_per_s": base,
        "splitserve_tokens_per_s": rates,
        "splitserve_float32_torch_tokens_per_s": before,
        "transformers_tokens_per_s": transformers,
        "splitserve_bf16_weights_tokens_per_s": bf16,
        "bf16_weights_batch32_vs_llamacpp_batch1": bf16.get(32, 0.0) / base,
        "batch1_vs_llamacpp": rates.get(1, 0.0) / base,
        "batch32_vs_llamacpp_batch1": rates.get(32, 0.0) / base,
        "targets": {"batch1_vs_llamacpp": 1.0, "batch32_vs_llamacpp_batch1": 5.0},
    }
    out = Path(ours_path).with_name(out_name)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"llama.cpp batch 1: {base:.1f} tok/s ({llamacpp['model']}, {llamacpp['threads']} threads)"
    )
    for batch, rate in sorted(rates.items()):
        extra = f", float32+torch {before[batch]:.1f}" if batch in before else ""
        if batch in bf16:
            extra += f", bf16 weights {bf16[batch]:.1f} ({bf16[batch] / base:.2f}x)"
        hf = f", transformers {transformers[batch]:.1f}" if batch in transformers else ""
        ratio = rate / base
        print(f"splitserve batch {batch}: {rate:.1f} tok/s = {ratio:.2f}x llama.cpp b1{hf}{extra}")
    print(f"wrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="OURS LLAMACPP [FLOAT32 [BF16]]")
    parser.add_argument("--out", default="cpu-versus-llamacpp.json")
    args = parser.parse_args()
    main(*args.paths, out_name=args.out)

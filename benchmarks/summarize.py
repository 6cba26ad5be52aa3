"""Print Markdown tables from benchmark result files (offline and serving sweeps)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def offline_table(result: dict[str, Any]) -> list[str]:
    ceilings, reference = result["ceilings"], result.get("reference_ceilings")
    nan = float("nan")
    title = (
        f"Offline, {result['model_id']} on {result['device_name']} ({result['dtype']}), "
        f"commit {str(result['git_commit'])[:10]}; measured ceilings "
        f"{ceilings['bandwidth_gb_per_s']:.1f} GB/s, {ceilings['matmul_tflops']:.3f} TFLOP/s"
    )
    if reference:
        title += (
            f"; reference {reference['bandwidth_gb_per_s']:.0f} GB/s, "
            f"{reference['matmul_tflops']:.0f} TFLOP/s"
        )
    lines = [
        title,
        "",
        "| batch | steady steps | splitserve decode tok/s | MBU (measured / reference) "
        "| transformers decode tok/s | speedup | compiled peer decode tok/s | speedup |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["decode"]:
        ours, base, peer = row["splitserve"], row.get("transformers", {}), row.get("compiled", {})
        lines.append(
            f"| {row['batch']} | {ours.get('decode_steps', '')} "
            f"| {ours['decode_tokens_per_s']:.1f} "
            f"| {ours['mbu_decode']:.1%} / {ours.get('mbu_decode_reference', nan):.1%} "
            f"| {base.get('decode_tokens_per_s', nan):.1f} "
            f"| {row.get('speedup_decode', nan):.2f}x "
            f"| {peer.get('decode_tokens_per_s', nan):.1f} "
            f"| {row.get('speedup_decode_vs_compiled', nan):.2f}x |"
        )
    if "prefill" in result:
        prefill = result["prefill"]
        lines.append(
            f"\nPrefill of {result['config']['prefill_len']} tokens: "
            f"{prefill['prefill_tokens_per_s']:.0f} tok/s, MFU {prefill['mfu_prefill']:.1%}"
            f" (reference {prefill.get('mfu_prefill_reference', nan):.1%})"
        )
    return lines


def serve_table(name: str, result: dict[str, Any]) -> list[str]:
    lines = [
        f"Serving, {name} (commit {str(result['git_commit'])[:10]})",
        "",
        "| rate (req/s) | completed | failed | output tok/s | mean TTFT ms | p99 TTFT ms "
        "| mean TPOT ms | p99 ITL ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in result.get("runs", [result]):
        lines.append(
            f"| {run['request_rate']} | {run['completed']} | {run['failed']} "
            f"| {run['output_throughput']:.1f} | {run['mean_ttft_ms']:.0f} "
            f"| {run['p99_ttft_ms']:.0f} | {run['mean_tpot_ms']:.1f} | {run['p99_itl_ms']:.1f} |"
        )
    return lines


def main(paths: list[str]) -> int:
    for path in paths:
        result = json.loads(Path(path).read_text())
        if "decode" in result:
            lines = offline_table(result)
        elif "runs" in result and "config" in result:
            lines = serve_table(Path(path).stem, result)
        else:  # llama.cpp's runs and the comparison: cpu/versus_llamacpp.py prints those
            continue
        print("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""MoE on one GPU: the grouped expert GEMM against a per-expert loop of cuBLAS calls, and
transformers' decode rate on an MoE shape (the baseline that ``bench offline`` cannot load in
the same process as the engine: two copies of Qwen3-30B-A3B's 61 GB do not fit one H200).

    python3 -m benchmarks.moe.moe gemm            # Qwen3-30B-A3B experts, 1 / 64 / 256 tokens
    python3 -m benchmarks.moe.moe hf --shape qwen3-30b-a3b --batch-sizes 1,64,256
    python3 -m benchmarks.moe.moe tiles --batch-sizes 1,4,16,64,256   # the tiling sweep

Each prints one JSON line and writes it to $OUT/moe-<mode>.json when OUT is set. ``gemm``
checks the kernel against ``grouped_gemm_ref`` in bfloat16 (exits 1 on a mismatch) and
reports each variant's time and the bandwidth of the expert weights it reads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from splitserve.bench.report import git_commit
from splitserve.engine.layers.moe import permute, route
from splitserve.kernels.grouped_gemm import (
    GemmTiles,
    choose_tiles,
    grouped_gemm,
    grouped_gemm_ref,
)


def _time_us(fn: Any, repeats: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / repeats


def _graph_time_us(fn: Any, repeats: int = 50) -> float:
    """Device time per call: ``repeats`` calls captured in one CUDA graph, replayed. Timed
    eagerly, a launch of a few microseconds of work measures the host's launch overhead
    (about 280 us per grouped GEMM call with its tile schedule, whatever the tiling); in the
    engine the decode step is a graph too."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / repeats


def cublas_loop(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, rows: Any) -> Any:
    """The baseline: one F.linear (cuBLAS) per expert with rows, offsets read on the host."""
    return grouped_gemm_ref(x, weight, offsets, rows)


def _cases(experts: int, top_k: int, hidden: int, inter: int, tokens: list[int]) -> Any:
    """For each token count: (count, active experts, [(projection, weight, input, rows)]),
    Qwen3-30B-A3B-like random bf16 experts and routing (seed 0)."""
    torch.manual_seed(0)
    dtype, device = torch.bfloat16, torch.device("cuda")
    w13 = torch.randn(experts, 2 * inter, hidden, dtype=dtype, device=device) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, dtype=dtype, device=device) / inter**0.5
    for count in tokens:
        x = torch.randn(count, hidden, dtype=dtype, device=device)
        routing = route(torch.randn(count, experts, device=device), top_k, True)
        perm = permute(routing.experts, experts)
        act = torch.randn(count * top_k, inter, dtype=dtype, device=device)
        active = int((perm.counts > 0).sum())
        yield count, active, perm, (("gate_up", w13, x, perm.rows), ("down", w2, act, None))


def gemm(experts: int, top_k: int, hidden: int, inter: int, tokens: list[int]) -> dict[str, Any]:
    rows_out, ok = [], True
    for count, active, perm, projections in _cases(experts, top_k, hidden, inter, tokens):
        row: dict[str, Any] = {"tokens": count, "active_experts": active}
        for name, weight, inp, rows in projections:
            ours = grouped_gemm(inp, weight, perm.offsets, rows)
            ref = cublas_loop(inp, weight, perm.offsets, rows)
            err = float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())
            ok &= err < 2e-2
            kernel_us = _graph_time_us(lambda: grouped_gemm(inp, weight, perm.offsets, rows))  # noqa: B023
            eager_us = _time_us(lambda: grouped_gemm(inp, weight, perm.offsets, rows))  # noqa: B023
            loop_us = _time_us(lambda: cublas_loop(inp, weight, perm.offsets, rows))  # noqa: B023
            read = active * weight[0].numel() * weight.element_size()
            row[name] = {
                "max_rel_err": err,
                "grouped_us": kernel_us,
                "grouped_eager_us": eager_us,
                "cublas_loop_us": loop_us,
                "grouped_gb_per_s": read / kernel_us / 1e3,
                "cublas_loop_gb_per_s": read / loop_us / 1e3,
            }
        rows_out.append(row)
    shape = {"experts": experts, "top_k": top_k, "hidden": hidden, "inter": inter}
    return {"mode": "gemm", "ok": ok, "shape": shape, "rows": rows_out}


def tiles(experts: int, top_k: int, hidden: int, inter: int, tokens: list[int]) -> dict[str, Any]:
    """Every tiling of a grid (tile widths, split-K, pipeline stages) for each token count and
    projection: its time against the default's, outputs checked against the reference."""
    import itertools

    grid = list(itertools.product((32, 64, 128), (64, 128, 256), (1, 2, 4, 8, 16), (3, 4)))
    rows_out, ok = [], True
    for count, active, perm, projections in _cases(experts, top_k, hidden, inter, tokens):
        row: dict[str, Any] = {"tokens": count, "active_experts": active}
        for name, weight, inp, rows in projections:
            ref = grouped_gemm_ref(inp, weight, perm.offsets, rows).float()
            read = active * weight[0].numel() * weight.element_size()
            default = choose_tiles(perm.rows.numel(), experts, weight.shape[2])
            timed = []
            for block_n, block_k, split_k, stages in grid:
                t = GemmTiles(default.block_m, block_n, block_k, split_k, 4, stages)
                out = grouped_gemm(inp, weight, perm.offsets, rows, t).float()
                err = float((out - ref).abs().max() / ref.abs().max())
                ok &= err < 2e-2
                us = _graph_time_us(lambda: grouped_gemm(inp, weight, perm.offsets, rows, t))  # noqa: B023
                timed.append((us, t))
            default_us = _graph_time_us(lambda: grouped_gemm(inp, weight, perm.offsets, rows))  # noqa: B023
            timed.sort(key=lambda pair: pair[0])
            row[name] = {
                "default": default.__dict__,
                "default_us": default_us,
                "default_gb_per_s": read / default_us / 1e3,
                "best": [
                    {"us": us, "gb_per_s": read / us / 1e3, **t.__dict__} for us, t in timed[:5]
                ],
            }
        rows_out.append(row)
    shape = {"experts": experts, "top_k": top_k, "hidden": hidden, "inter": inter}
    return {"mode": "tiles", "ok": ok, "shape": shape, "rows": rows_out}


def hf(shape: str, batch_sizes: list[int], input_len: int, output_len: int) -> dict[str, Any]:
    from splitserve.bench.hf_baseline import hf_throughput, load_hf_model
    from splitserve.bench.roofline import REFERENCE_CEILINGS, decode_step_bytes
    from splitserve.engine.shapes import SHAPES

    device = torch.device("cuda")
    model = load_hf_model(f"shape:{shape}", device, torch.bfloat16)
    cfg, bandwidth = SHAPES[shape], REFERENCE_CEILINGS[("H200", torch.bfloat16)]
    generator = torch.Generator().manual_seed(0)
    rows = []
    for batch in batch_sizes:
        prompts = torch.randint(100, cfg.vocab_size, (batch, input_len), generator=generator)
        stats = hf_throughput(model, prompts.tolist(), output_len, device)
        context = input_len + output_len / 2
        step_bytes = decode_step_bytes(cfg, 2, batch, round(context))
        stats["mbu_decode_reference"] = (
            step_bytes * stats["decode_tokens_per_s"] / batch / bandwidth.bandwidth_bytes_per_s
        )
        rows.append({"batch": batch} | stats)
    return {"mode": "hf", "shape": shape, "input_len": input_len, "rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["gemm", "hf", "tiles"])
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    if args.mode == "gemm":
        result = gemm(128, 8, 2048, 768, batches)
    elif args.mode == "tiles":
        result = tiles(128, 8, 2048, 768, batches)
    else:
        result = hf(args.shape, batches, args.input_len, args.output_len)
    result |= {"git_commit": git_commit(), "device": torch.cuda.get_device_name()}
    line = json.dumps(result)
    print(line)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"moe-{args.mode}.json").write_text(line + "\n")
    return 0 if result.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())

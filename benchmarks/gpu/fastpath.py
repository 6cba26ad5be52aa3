"""The small-batch decode kernels on the GPU: checks against their references, then timings.

Run on the GPU machine from the repository root:

    python3 -m benchmarks.gpu.fastpath [--sweep]

1. bfloat16 checks: the GEMV (plain, with norm and residual, gated, with bias), the
   fused rotary + K/V write, the two-launch argmax, each against its torch reference.
2. Timings inside CUDA graphs (``triton.testing.do_bench_cudagraph``, so launch gaps count as
   they do in a decode step): each projection of the Llama-3-8B and SmolLM2-135M shapes at one
   row, weights cycling through copies larger than the L2 cache (as in a model), the GEMV
   (the engine's tile choice; with --sweep every tile candidate) beside cuBLAS;
   after a norm, the three decode paths (fused, norm kernel + GEMV, norm + cuBLAS + SiLU);
   decode attention at batch 1 for several split / tile choices; argmax beside torch's.

Prints a table; writes JSON to $OUT/fastpath.json (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.testing

ROOT = Path(__file__).resolve().parents[2]

from splitserve.kernels import activation, argmax, decode_attention, rmsnorm, rotary  # noqa: E402
from splitserve.kernels.gemv import Tiles, choose_tiles, gemv, gemv_ref  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
# (hidden, heads, kv_heads, head_dim, intermediate, vocab)
SHAPES = {
    "llama3-8b": (4096, 32, 8, 128, 14336, 128256),
    "smollm2-135m": (576, 9, 3, 64, 1536, 49152),
}


def us(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
    """µs per call of fn(*args, **kwargs), replayed from a CUDA graph."""
    return float(triton.testing.do_bench_cudagraph(lambda: fn(*args, **kwargs), rep=30)) * 1000


def max_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.float()
    return ((actual.float() - expected).abs() / (1 + expected.abs())).max().item()


def checks() -> list[dict[str, Any]]:
    rows = []
    torch.manual_seed(0)
    for n, k, gated, res, bias in [
        (6144, 4096, False, True, False),
        (14336, 4096, True, True, False),
        (960, 576, False, True, True),
        (576, 1536, False, False, False),
    ]:
        x = torch.randn(1, k, dtype=BF16, device=DEV)
        w = torch.randn((2 if gated else 1) * n, k, dtype=BF16, device=DEV) / k**0.5
        r = torch.randn_like(x) if res else None
        nw = torch.randn(k, dtype=BF16, device=DEV) if res else None
        b = torch.randn(n, dtype=BF16, device=DEV) if bias else None
        out, summed = gemv(x, w, b, residual=r, norm_weight=nw, gated=gated)
        ref, ref_sum = gemv_ref(x, w, b, residual=r, norm_weight=nw, gated=gated)
        err = max_err(out, ref)
        if r is not None:
            assert summed is not None and ref_sum is not None
            err = max(err, max_err(summed, ref_sum))
        name = f"gemv n={n} k={k} gated={gated} res={res} bias={bias}"
        rows.append({"check": name, "max_err": err, "ok": err <= 1.6e-2})

    heads, kv_heads, dim, bs = 32, 8, 128, 16
    cache = torch.randn(2, 40, bs, kv_heads, dim, dtype=BF16, device=DEV)
    ref_cache = cache.clone()
    tokens = 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, dtype=BF16, device=DEV)
    slots = torch.tensor([3, 17, -1, 600, 100], device=DEV)
    positions = torch.tensor([3, 17, 40, 600, 100], device=DEV)
    rot = _rotary_tables(dim)
    q = rotary.rotary_kv_write(positions, qkv, heads, *rot, cache[0], cache[1], slots)
    q_ref, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    q_ref, k_ref = rotary.rotary_embedding_ref(
        positions, q_ref.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), *rot
    )
    keep = slots >= 0
    for layer, src in ((0, k_ref), (1, v.reshape(tokens, kv_heads, dim))):
        ref_cache[layer].view(-1, kv_heads, dim)[slots[keep]] = src[keep]
    err = max(max_err(q, q_ref), max_err(cache, ref_cache))
    rows.append({"check": "rotary_kv_write", "max_err": err, "ok": err <= 1.6e-2})

    # Rotary + K/V write + decode attention in one launch against the two launches.
    for splits in (1, 8):
        cache = torch.randn(2, 40, bs, kv_heads, dim, dtype=BF16, device=DEV)
        ref_cache = cache.clone()
        lens = torch.tensor([1, 50, 111, 160], device=DEV)  # tables of 10 blocks of 16
        tables = torch.randperm(40, device=DEV).view(4, 10)
        pos = lens - 1
        slots = tables.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
        qkv = torch.randn(4, (heads + 2 * kv_heads) * dim, dtype=BF16, device=DEV)
        out = decode_attention.paged_decode_attention_qkv(
            qkv, heads, pos, *rot, slots, cache[0], cache[1], tables, lens, dim**-0.5,
            num_splits=splits,
        )  # fmt: skip
        q = rotary.rotary_kv_write(pos, qkv, heads, *rot, ref_cache[0], ref_cache[1], slots)
        ref = decode_attention.paged_decode_attention_ref(
            q, ref_cache[0], ref_cache[1], tables, lens, dim**-0.5
        )
        err = max(max_err(out, ref), max_err(cache, ref_cache))
        name = f"decode_attention_qkv splits={splits}"
        rows.append({"check": name, "max_err": err, "ok": err <= 1.6e-2})

    logits = torch.randn(3, 128256, device=DEV)
    logits[1, 5000] = logits[1, 90000] = 50.0
    same = torch.equal(argmax.argmax_rows(logits), logits.argmax(-1))
    rows.append({"check": "argmax_rows", "max_err": 0.0 if same else 1.0, "ok": same})
    return rows


def _rotary_tables(dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    from splitserve.engine.layers.rotary import RotaryEmbedding

    emb = RotaryEmbedding(dim, 1024, 500000.0, None)
    return emb.cos.to(DEV), emb.sin.to(DEV)


CANDIDATES = [
    Tiles(bn, bk, warps)
    for bn, bk, warps in itertools.product((4, 8, 16, 32), (128, 256, 512, 1024), (4, 8))
    if 1024 <= bn * bk <= 8192
]


def cold_us(fn: Callable[..., Any], copies: list[torch.Tensor], *args: Any, **kw: Any) -> float:
    """µs per call of fn(x, w, ...) with w cycling through copies larger than the L2 cache
    together, so that weights come from memory as in a model's layers."""

    def run_all() -> None:
        for w in copies:
            fn(args[0], w, *args[1:], **kw)

    return us(run_all) / len(copies)


def try_us(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
    """cold_us(), or infinity for a tile choice the GPU cannot run (shared memory, registers)."""
    try:
        return cold_us(fn, *args, **kwargs)
    except Exception as exc:
        print(f"skipped {kwargs.get('tiles')}: {type(exc).__name__}")
        return float("inf")


def projections(sweep: bool) -> list[dict[str, Any]]:
    """One row: cuBLAS beside the GEMV; after a norm, the three decode paths of the engine."""
    rows = []
    for shape, (hidden, heads, kv_heads, dim, inter, vocab) in SHAPES.items():
        projs = {
            "qkv": ((heads + 2 * kv_heads) * dim, hidden, False),
            "o": (hidden, heads * dim, False),
            "gate_up": (2 * inter, hidden, True),
            "down": (hidden, inter, False),
            "lm_head": (vocab, hidden, False),
        }
        for name, (n, k, gated) in projs.items():
            nbytes = n * k * 2
            copies = [
                torch.randn(n, k, dtype=BF16, device=DEV) / k**0.5
                for _ in range(max(2, -(-(256 << 20) // nbytes)))
            ]
            x = torch.randn(1, k, dtype=BF16, device=DEV)
            row: dict[str, Any] = {"shape": shape, "proj": name, "n": n, "k": k}
            row["tiles"] = choose_tiles(k).__dict__
            row["cublas_us"] = cold_us(F.linear, copies, x)
            row["gemv_us"] = cold_us(gemv, copies, x, gated=gated)
            row["gemv_gbps"] = nbytes / row["gemv_us"] / 1e3
            row["cublas_gbps"] = nbytes / row["cublas_us"] / 1e3
            if sweep:
                timed = [(try_us(gemv, copies, x, gated=gated, tiles=t), t) for t in CANDIDATES]
                best = min(timed, key=lambda r: r[0])
                row["best_us"], row["best_tiles"] = best[0], best[1].__dict__
                row["sweep"] = [{"us": t_us, **t.__dict__} for t_us, t in timed]
            if name in ("qkv", "gate_up"):
                res, nw = torch.randn_like(x), torch.randn(k, dtype=BF16, device=DEV)
                row["path_us"] = {
                    "fused": cold_us(_fused, copies, x, res, nw, gated),
                    "gemv": cold_us(_norm_then_gemv, copies, x, res, nw, gated),
                    "separate": cold_us(_separate, copies, x, res, nw, gated),
                }
            del copies
            rows.append(row)
    return rows


def _fused(
    x: torch.Tensor, w: torch.Tensor, res: torch.Tensor, nw: torch.Tensor, gated: bool
) -> torch.Tensor:
    return gemv(x, w, residual=res, norm_weight=nw, gated=gated)[0]


def _norm_then_gemv(
    x: torch.Tensor, w: torch.Tensor, res: torch.Tensor, nw: torch.Tensor, gated: bool
) -> torch.Tensor:
    h, _ = rmsnorm.fused_add_rms_norm(x, res, nw, 1e-5)
    return gemv(h, w, gated=gated)[0]


def _separate(
    x: torch.Tensor, w: torch.Tensor, res: torch.Tensor, nw: torch.Tensor, gated: bool
) -> torch.Tensor:
    h, _ = rmsnorm.fused_add_rms_norm(x, res, nw, 1e-5)
    out = F.linear(h, w)
    return activation.silu_and_mul(out) if gated else out


def attention() -> list[dict[str, Any]]:
    rows = []
    bs, width = 16, 128  # a 2k-token block table, like the benchmark's graphs
    for shape, (_, heads, kv_heads, dim, _, _) in SHAPES.items():
        for batch, context in ((1, 1024), (64, 1024)):
            if shape == "smollm2-135m" and batch == 64:
                continue
            blocks = batch * width + 1
            k_cache = torch.randn(blocks, bs, kv_heads, dim, dtype=BF16, device=DEV)
            v_cache = torch.randn_like(k_cache)
            tables = torch.randperm(blocks - 1, device=DEV)[: batch * width].view(batch, width)
            lens = torch.full((batch,), context, device=DEV)
            q = torch.randn(batch, heads, dim, dtype=BF16, device=DEV)
            args = (q, k_cache, v_cache, tables, lens, dim**-0.5)
            ref = decode_attention.paged_decode_attention_ref(*args)
            variants: list[tuple[int | None, int | None, int]] = [(None, None, 4)]
            if batch == 1:
                variants += list(itertools.product((8, 16, 32), (16, 32, 64, 128), (2, 4)))
            if batch == 1:  # on copies: it writes the newest token's K/V into the caches
                caches = k_cache.clone(), v_cache.clone()
                rows += _attention_qkv(shape, q, *caches, tables, lens)
            for splits, block_n, warps in variants:
                kw = dict(num_splits=splits, block_n=block_n, num_warps=warps)
                fn = decode_attention.paged_decode_attention
                err = max_err(fn(*args, **kw), ref)
                rows.append({
                    "shape": shape, "batch": batch, "context": context, "splits": splits,
                    "block_n": block_n, "warps": warps, "us": us(fn, *args, **kw), "max_err": err,
                    "ok": err <= 1.6e-2,
                })  # fmt: skip
    return rows


def _attention_qkv(
    shape: str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
) -> list[dict[str, Any]]:
    """A decode step's attention from the q|k|v projection: rotary_kv_write then attention
    (two launches) against paged_decode_attention_qkv (one)."""
    batch, heads, dim = q.shape
    kv_heads, bs = k_cache.shape[2], k_cache.shape[1]
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * dim, dtype=BF16, device=DEV)
    rot = _rotary_tables(dim)
    pos = lens - 1
    slots = tables.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
    scale = dim**-0.5

    def two_launches() -> torch.Tensor:
        q = rotary.rotary_kv_write(pos, qkv, heads, *rot, k_cache, v_cache, slots)
        return decode_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)

    def one_launch() -> torch.Tensor:
        return decode_attention.paged_decode_attention_qkv(
            qkv, heads, pos, *rot, slots, k_cache, v_cache, tables, lens, scale
        )

    context = int(lens[0])
    return [
        {"shape": shape, "batch": batch, "context": context, "variant": name, "us": us(fn)}
        for name, fn in (("rotary_kv_write + attention", two_launches), ("qkv", one_launch))
    ]


def argmax_rows() -> list[dict[str, Any]]:
    rows = []
    for batch, vocab in ((1, 128256), (1, 49152), (64, 128256)):
        logits = torch.randn(batch, vocab, device=DEV)
        rows.append({
            "batch": batch, "vocab": vocab,
            "torch_us": us(torch.argmax, logits, -1),
            "triton_us": us(argmax.argmax_rows, logits),
        })  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--skip-attention", action="store_true")
    args = parser.parse_args()
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    result: dict[str, Any] = {
        "git_commit": os.environ.get("SPLITSERVE_GIT_COMMIT", commit),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "checks": checks(),
        "argmax": argmax_rows(),
        "projections": projections(args.sweep),
        "attention": [] if args.skip_attention else attention(),
    }
    out = Path(os.environ.get("OUT", ROOT / "benchmarks" / "results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "fastpath.json").write_text(json.dumps(result, indent=1) + "\n")
    for c in result["checks"]:
        print(f"check {c['check']:<55} err {c['max_err']:.2e} {'ok' if c['ok'] else 'FAIL'}")
    for a in result["argmax"]:
        print(f"argmax B={a['batch']} V={a['vocab']}: torch {a['torch_us']:.1f} us, "
              f"triton {a['triton_us']:.1f} us")  # fmt: skip
    for p in result["projections"]:
        extra = ""
        if "best_us" in p:
            extra += f" best {p['best_us']:.1f} {tuple(p['best_tiles'].values())[:3]}"
        if "path_us" in p:
            extra += " | after norm: " + " ".join(f"{k} {v:.1f}" for k, v in p["path_us"].items())
        print(f"{p['shape']:<13} {p['proj']:<8} cublas {p['cublas_us']:6.1f} "
              f"({p['cublas_gbps']:5.0f} GB/s) gemv {p['gemv_us']:6.1f} "
              f"({p['gemv_gbps']:5.0f} GB/s){extra}")  # fmt: skip
    for shape in SHAPES:
        for batch in (1, 64):
            rows = [
                r
                for r in result["attention"]
                if r["shape"] == shape and r["batch"] == batch and "variant" not in r
            ]
            if not rows:
                continue
            default = rows[0]
            best = min(rows, key=lambda r: r["us"])
            print(f"attention {shape} B={batch}: default {default['us']:.1f} us; best "
                  f"{best['us']:.1f} us at splits={best['splits']} block_n={best['block_n']} "
                  f"warps={best['warps']} (err {best['max_err']:.1e})")  # fmt: skip
    for r in result["attention"]:
        if "variant" in r:
            print(f"attention {r['shape']} B=1 from q|k|v: {r['variant']} {r['us']:.1f} us")
    bad = [a for a in result["attention"] if not a.get("ok", True)]
    for a in bad:
        print(f"FAIL attention {a}")
    return 0 if all(c["ok"] for c in result["checks"]) and not bad else 1


if __name__ == "__main__":
    sys.exit(main())

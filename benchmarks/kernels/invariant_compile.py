"""Compiles deterministic mode's Triton kernels for Hopper (sm_90a) on a machine without a GPU,
with Triton's own ptxas, and prints each variant's registers and spills: the compile errors
and register spills the interpreter cannot show. Integer arguments the launches leave
specialised are taken as multiples of 16 (Llama-3-8B's strides), as Triton's JIT would.

    .venv/bin/python -m benchmarks.kernels.invariant_compile
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from splitserve.kernels import invariant_attention as attention
from splitserve.kernels import invariant_matmul as matmul
from splitserve.kernels import moe_route

TARGET = GPUTarget("cuda", 90, 32)
UNSPECIALISED = {"M", "num_decode", "dec_stride", "pre_stride", "scale", "hidden"}


def compile_variant(name: str, fn: Any, signature: dict[str, str], **constants: Any) -> str:
    """One line: the variant's registers and spills from ptxas -v."""
    num_warps = constants.pop("num_warps", 4)
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, (arg, kind) in enumerate(signature.items())
        if kind != "constexpr" and arg not in UNSPECIALISED
    }
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    kernel = triton.compile(source, target=TARGET, options={"num_warps": num_warps})
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas-blackwell"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp, "k.ptx")
        ptx.write_text(kernel.asm["ptx"])
        out = subprocess.run(
            [str(ptxas), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", str(Path(tmp, "k.o"))],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    regs = re.search(r"Used (\d+) registers", out.stderr)
    spills = re.search(r"(\d+) bytes spill stores", out.stderr)
    used, spilled = regs[1] if regs else "?", spills[1] if spills else "?"
    return f"{name:40} registers {used:>4}  spill stores {spilled} B"


def main() -> None:
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    gemm = dict.fromkeys(["x_ptr", "w_ptr", "bias_ptr", "out_ptr"], "*bf16") | dict.fromkeys(
        ["M", "N", "K", "k_per_split", "stride_x", "stride_w", "stride_out"], "i32"
    )
    gemm |= dict.fromkeys(
        ["SPLITS", "HAS_BIAS", "PARTIAL", "PRECISION", "BLOCK_M", "BLOCK_N", "BLOCK_K", "PDL"],
        "constexpr",
    )
    tiles = dict(BLOCK_M=matmul.BLOCK_M, BLOCK_N=matmul.BLOCK_N, BLOCK_K=matmul.BLOCK_K)
    for partial, splits in ((False, 1), (True, 4), (False, 4)):
        sig = gemm | {"out_ptr": "*fp32" if partial else "*bf16"}
        print(compile_variant(
            f"matmul splits={splits} partial={partial}", matmul._invariant_matmul_kernel, sig,
            SPLITS=splits, HAS_BIAS=True, PARTIAL=partial, PRECISION="tf32", PDL=True,
            num_warps=matmul.NUM_WARPS, **tiles,
        ))  # fmt: skip
    sums = {"part_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32", "N": "i32",
            "stride_out": "i32", "SPLITS": "constexpr", "HAS_BIAS": "constexpr",
            "BLOCK": "constexpr", "PDL": "constexpr"}  # fmt: skip
    print(compile_variant("sum splits=4", matmul._sum_splits_kernel, sums,
                          SPLITS=4, HAS_BIAS=True, BLOCK=1024, PDL=True))  # fmt: skip
    attn = dict.fromkeys(["q_ptr", "k_ptr", "v_ptr", "out_ptr"], "*bf16") | {
        "dec_tables": "*i64", "dec_lens": "*i64", "dec_stride": "i32", "num_decode": "i32",
        "tile_rows": "*i32", "tile_firsts": "*i32", "tile_counts": "*i32", "tile_seqs": "*i32",
        "pre_tables": "*i64", "pre_stride": "i32",
    }  # fmt: skip
    attn |= dict.fromkeys(
        ["stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kb", "stride_ks", "stride_kh"],
        "i32",
    ) | {"scale": "fp32"}
    attn |= dict.fromkeys(
        ["GROUP", "HEAD_DIM", "PAD_D", "BLOCK_SIZE", "BLOCK_M", "BLOCK_N", "KV_SPLIT",
         "PRECISION", "PDL"], "constexpr",
    )  # fmt: skip
    for group in (4, 8):  # Llama-3-8B, Qwen3-30B-A3B
        print(compile_variant(
            f"attention group={group} dim=128", attention._invariant_attention_kernel, attn,
            GROUP=group, HEAD_DIM=128, PAD_D=128, BLOCK_SIZE=16, BLOCK_M=attention.BLOCK_M,
            BLOCK_N=attention.BLOCK_N, KV_SPLIT=attention.KV_SPLIT, PRECISION="tf32",
            PDL=True, num_warps=attention.NUM_WARPS,
        ))  # fmt: skip
    split = (
        dict.fromkeys(["q_ptr", "k_ptr", "v_ptr"], "*bf16")
        | dict.fromkeys(["part_m", "part_sum", "part_acc"], "*fp32")
        | {"dec_tables": "*i64", "dec_lens": "*i64", "dec_stride": "i32", "num_decode": "i32"}
    )
    split |= {name: attn[name] for name in ("stride_qt", "stride_qh", "stride_kb", "stride_ks",
                                            "stride_kh", "scale")}  # fmt: skip
    split |= dict.fromkeys(
        ["HEADS", "GROUP", "HEAD_DIM", "PAD_D", "BLOCK_SIZE", "BLOCK_M", "BLOCK_N", "KV_SPLIT",
         "PRECISION", "PDL"], "constexpr",
    )  # fmt: skip
    shapes = dict(GROUP=4, HEAD_DIM=128, PAD_D=128, BLOCK_M=attention.BLOCK_M,
                  KV_SPLIT=attention.KV_SPLIT, PDL=True, num_warps=attention.NUM_WARPS)  # fmt: skip
    print(compile_variant(
        "decode split group=4 dim=128", attention._decode_split_kernel, split, HEADS=32,
        BLOCK_SIZE=16, BLOCK_N=attention.BLOCK_N, PRECISION="tf32", **shapes,
    ))  # fmt: skip
    merge = dict.fromkeys(["part_m", "part_sum", "part_acc"], "*fp32") | {
        "out_ptr": "*bf16", "dec_lens": "*i64", "num_decode": "i32", "stride_ot": "i32",
        "stride_oh": "i32",
    }  # fmt: skip
    merge |= dict.fromkeys(
        ["HEADS", "GROUP", "HEAD_DIM", "PAD_D", "BLOCK_M", "KV_SPLIT", "PDL"], "constexpr"
    )
    print(compile_variant(
        "decode merge group=4 dim=128", attention._decode_merge_kernel, merge, HEADS=32, **shapes
    ))  # fmt: skip
    combine = {"rows_ptr": "*bf16", "weights_ptr": "*fp32", "out_ptr": "*bf16",
               "hidden": "i32", "TOP_K": "constexpr", "BLOCK_H": "constexpr"}  # fmt: skip
    print(compile_variant("ordered combine top_k=8", moe_route._ordered_combine_kernel,
                          combine, TOP_K=8, BLOCK_H=1024))  # fmt: skip


if __name__ == "__main__":
    main()

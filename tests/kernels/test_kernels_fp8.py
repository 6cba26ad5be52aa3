"""The FP8 x FP8 GEMMs (block-scaled weights, per-token-group activations) against their
dequantizing torch references (``kernels/fp8_quant.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("triton")

from splitserve.engine.fp8_weights import to_fp8_layers
from splitserve.engine.layers import fp8_linear
from splitserve.engine.layers.moe import SparseMoE
from splitserve.engine.layers.norm import RMSNorm
from splitserve.engine.model_config import MoEConfig
from splitserve.kernels.dispatch import set_kernels_on_cpu
from splitserve.kernels.fp8_act import quantize_groups_kernel
from splitserve.kernels.fp8_dense import DenseTiles, choose_dense_tiles, fp8_dense_gemm
from splitserve.kernels.fp8_quant import (
    BlockFp8,
    dequantize_blocks,
    fp8_grouped_ref,
    fp8_matmul_ref,
    quantize_blocks,
    quantize_groups,
)
from splitserve.kernels.grouped_gemm import GemmTiles, fp8_gemm, fp8_grouped_gemm
from tests.support.hopper_compile import compile_outside_interpreter

# Both sides sum exact FP8 products in float32, in a different order.
TOLERANCE = 1e-5


@pytest.mark.parametrize(
    "tiles", [GemmTiles(16, 32, 64), GemmTiles(16, 64, 32, split_k=3)], ids=["k64", "split-k"]
)
def test_fp8_gemm_matches_the_dequantized_product(tiles: GemmTiles) -> None:
    """K = 200 (a partial second group), N = 150 (a partial second block of rows), 5 rows;
    split-k: 3 splits of 96 (a step never crosses a group)."""
    torch.manual_seed(0)
    x = torch.randn(5, 200) * torch.linspace(0.1, 10, 200)
    weight = quantize_blocks(torch.randn(150, 200) / 8)
    xq, xs = quantize_groups(x)
    out = fp8_gemm(xq, xs, weight, torch.float32, tiles)
    expected = fp8_matmul_ref(xq, xs, weight, torch.float32)
    torch.testing.assert_close(out, expected, atol=TOLERANCE, rtol=TOLERANCE)


DENSE_CASES = {
    "partial": (5, 150, 200, DenseTiles(16, 32)),  # a partial row, column and K tile
    "split-k": (5, 150, 200, DenseTiles(16, 64, split_k=2)),  # 2 splits of 128: the last partial
    "even": (20, 128, 256, DenseTiles(16, 64, split_k=2, group_m=2)),  # no masks on the weight
}


@pytest.mark.parametrize("case", DENSE_CASES, ids=list(DENSE_CASES))
@pytest.mark.parametrize("quantized", [True, False], ids=["w8a8", "w8a16"])
def test_fp8_dense_gemm_matches_the_dequantized_product(case: str, quantized: bool) -> None:
    """The dense launch on quantized rows (against ``fp8_matmul_ref``) and on rows in their
    dtype (against the product with the dequantized weight)."""
    m, n, k, tiles = DENSE_CASES[case]
    torch.manual_seed(2)
    x = torch.randn(m, k) * torch.linspace(0.1, 10, k)
    weight = quantize_blocks(torch.randn(n, k) / 8)
    if quantized:
        xq, xs = quantize_groups(x)
        out = fp8_dense_gemm(xq, xs, weight, torch.float32, tiles)
        expected = fp8_matmul_ref(xq, xs, weight, torch.float32)
    else:
        out = fp8_dense_gemm(x, None, weight, torch.float32, tiles)
        expected = x @ dequantize_blocks(weight).T
    torch.testing.assert_close(out, expected, atol=TOLERANCE, rtol=TOLERANCE)


def test_dense_tiles_split_k_until_the_tiles_fill_the_multiprocessors() -> None:
    """16 rows of q|k|v (192 column tiles of 32) take no split, of o (128 tiles) two, of a
    128 x 1024 weight (4 tiles) two (K is never split below 4 steps a split); quantized rows
    take 64 x 64 tiles up to 64 rows, 64 x 128 beyond."""
    assert choose_dense_tiles(16, 6144, 4096, False, 132).split_k == 1
    assert choose_dense_tiles(16, 4096, 4096, False, 132).split_k == 2
    assert choose_dense_tiles(1, 128, 1024, False, 132).split_k == 2
    assert choose_dense_tiles(64, 4096, 4096, True, 132) == DenseTiles(64, 64)
    assert choose_dense_tiles(8192, 4096, 4096, True, 132) == DenseTiles(64, 128)


def test_fp8_grouped_gemm_gathers_each_experts_rows() -> None:
    """Experts 0 and 4 have no rows; rows gathered from 7 tokens; bfloat16 out."""
    torch.manual_seed(1)
    offsets = torch.tensor([0, 0, 9, 12, 20, 20])
    weight = quantize_blocks(torch.randn(5, 140, 160) / 8)
    xq, xs = quantize_groups(torch.randn(7, 160))
    rows = torch.randint(0, 7, (20,))
    out = fp8_grouped_gemm(xq, xs, weight, offsets, torch.bfloat16, rows, GemmTiles(16, 32, 64))
    expected = fp8_grouped_ref(xq[rows], xs[rows], weight, offsets, torch.float32)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=1e-2)


def test_the_reference_is_the_float32_product_of_the_dequantized_operands() -> None:
    """Scales applied per group of K: a weight block and an activation group whose scales
    differ by powers of two give the exact product."""
    data = torch.full((2, 256), 2.0).to(torch.float8_e4m3fn)
    weight = BlockFp8(data, torch.tensor([[0.5, 4.0]]))
    x_fp8 = torch.ones(1, 256).to(torch.float8_e4m3fn)
    x_scale = torch.tensor([[1.0, 0.25]])
    out = fp8_matmul_ref(x_fp8, x_scale, weight, torch.float32)
    assert out.tolist() == [[128 * 2 * 0.5 + 128 * 2 * 4.0 * 0.25] * 2]


def test_fp8_gemm_on_rows_in_their_dtype_is_the_product_with_the_dequantized_weight() -> None:
    """W8A16 (no activation scales): dense and grouped with gathered rows, split-K too."""
    torch.manual_seed(4)
    x = torch.randn(5, 200)
    weight = quantize_blocks(torch.randn(150, 200) / 8)
    expected = x @ dequantize_blocks(weight).T
    for tiles in (GemmTiles(16, 32, 64), GemmTiles(16, 64, 32, split_k=3)):
        out = fp8_gemm(x, None, weight, torch.float32, tiles)
        torch.testing.assert_close(out, expected, atol=TOLERANCE, rtol=TOLERANCE)
    offsets = torch.tensor([0, 3, 3, 8])
    experts = quantize_blocks(torch.randn(3, 140, 160) / 8)
    tokens = torch.randn(4, 160)
    rows = torch.randint(0, 4, (8,))
    out = fp8_grouped_gemm(
        tokens, None, experts, offsets, torch.float32, rows, GemmTiles(16, 32, 64)
    )
    real = dequantize_blocks(experts)
    expected = torch.cat([tokens[rows[:3]] @ real[0].T, tokens[rows[3:]] @ real[2].T])
    torch.testing.assert_close(out, expected, atol=TOLERANCE, rtol=TOLERANCE)


def test_the_quantization_kernel_equals_the_reference_bit_for_bit() -> None:
    """Ragged last group, a zero group (the TINY scale), values of very different sizes, a
    ragged last tile of rows; laid out for cuBLAS: the same values, zero rows to a multiple
    of 16 and the scales column-major."""
    torch.manual_seed(5)
    x = torch.randn(19, 300) * torch.logspace(-3, 3, 300)
    x[1, 128:256] = 0
    data, scale = quantize_groups_kernel(x)
    ref_data, ref_scale = quantize_groups(x)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))
    data, scale = quantize_groups_kernel(x, for_cublas=True)
    assert data.shape == (32, 300) and scale.shape == (32, 3) and scale.stride() == (1, 32)
    assert torch.equal(scale[:19], ref_scale)
    assert torch.equal(data[:19].view(torch.uint8), ref_data.view(torch.uint8))
    assert data[19:].view(torch.uint8).eq(0).all()


@pytest.mark.parametrize("few_rows", ["w8a8", "w8a16"])
def test_fp8_layers_on_the_kernels_equal_the_cpu_path(
    few_rows: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An FP8 MoE layer (gathered rows, two grouped GEMMs) and an FP8 projection through the
    Triton kernels, against the same layers on the torch reference: with these few rows
    unquantized (w8a16, the default) and quantized (w8a8)."""
    if few_rows == "w8a8":
        monkeypatch.setattr(fp8_linear, "W8A16_MAX_ROWS", 0)
    torch.manual_seed(3)
    moe = SparseMoE(160, MoEConfig(num_experts=4, top_k=2, intermediate_size=64, renormalize=True))
    model = nn.Module()
    model.layers = nn.ModuleList([nn.ModuleDict({"mlp": moe, "proj": nn.Linear(160, 48)})])
    assert to_fp8_layers(model) == 2
    proj = model.layers[0]["proj"]
    x = torch.randn(6, 160)
    norm = RMSNorm(160, 1e-6)
    with torch.no_grad():
        expected = moe(x, None, norm)[0], proj(x)
        set_kernels_on_cpu(True)
        try:
            got = moe(x, None, norm)[0], proj(x)
        finally:
            set_kernels_on_cpu(False)
    for out, ref in zip(got, expected, strict=True):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_cublas_block_scaled_path_is_taken_only_where_it_was_checked() -> None:
    """The CPU (and a torch without the recipe) keeps the Triton launches: ``available`` is
    False there; on a GPU that has the recipe its product equals the dequantizing reference
    up to float32 summation order, and only whole 128-wide groups of enough rows go to it."""
    from splitserve.kernels import fp8_cublas

    assert not fp8_cublas.available(torch.device("cpu"))
    assert fp8_cublas.fits(fp8_cublas.MIN_ROWS, 256, 512)
    assert not fp8_cublas.fits(fp8_cublas.MIN_ROWS - 1, 256, 512)
    assert not fp8_cublas.fits(fp8_cublas.MIN_ROWS, 200, 512)
    if not (torch.cuda.is_available() and fp8_cublas.available(torch.device("cuda"))):
        return
    torch.manual_seed(0)
    x, w = torch.randn(300, 1024, device="cuda"), torch.randn(640, 1024, device="cuda")
    x_fp8, x_scale = quantize_groups(x)
    weight = quantize_blocks(w)
    got = fp8_cublas.block_scaled_mm(x_fp8, x_scale, weight, torch.bfloat16).float()
    want = fp8_matmul_ref(x_fp8, x_scale, weight, torch.float32)
    assert ((got - want).abs() / (1 + want.abs())).max() < 1e-2  # bfloat16's rounding


def test_cublas_takes_only_the_output_dtypes_its_probe_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """cuBLAS has no float32 output for block scales: float32 activations (``dtype="float32"``
    on a GPU) stay on the Triton launch from the first product, with no refused call and no
    warning per row count; the probe is asked for the product's own output dtype."""
    from splitserve.kernels import fp8_cublas

    probed: list[torch.dtype] = []

    def available(device: torch.device, out_dtype: torch.dtype = torch.bfloat16) -> bool:
        probed.append(out_dtype)
        return out_dtype != torch.float32  # as a GPU with the recipe answers

    def block_scaled_mm(*args: object) -> torch.Tensor:
        raise AssertionError("cuBLAS called for a float32 product")

    monkeypatch.setattr(fp8_cublas, "available", available)
    monkeypatch.setattr(fp8_cublas, "block_scaled_mm", block_scaled_mm)
    refused: list[tuple[int, int, int]] = []
    monkeypatch.setattr(fp8_cublas, "refused", lambda m, n, k, error: refused.append((m, n, k)))
    torch.manual_seed(4)
    x, weight = torch.randn(fp8_cublas.MIN_ROWS, 128), quantize_blocks(torch.randn(128, 128))
    set_kernels_on_cpu(True)
    try:
        got = fp8_linear.fp8_linear(x, weight)
    finally:
        set_kernels_on_cpu(False)
    assert not refused and probed in ([], [torch.float32])
    torch.testing.assert_close(got, fp8_matmul_ref(*quantize_groups(x), weight, torch.float32))


_SM90_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from splitserve.kernels import decode_attention, fp8_act, rotary

target = GPUTarget("cuda", 90, 32)


def compile_(fn, types, constants, num_warps=4):
    names = [n for n in fn.arg_names if n not in constants]
    signature = dict(zip(names, types, strict=True)) | {c: "constexpr" for c in constants}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
               if n.startswith("stride") or n.endswith("_ptr")}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=aligned)
    return triton.compile(source, target=target, options={"num_warps": num_warps}).asm["ptx"]


quantize = compile_(fp8_act._quantize_kernel, ["*bf16", "*fp8e4nv", "*fp32"] + ["i32"] * 7,
                    dict(ROWS=16, GROUP=128, FP8_MAX=448.0, TINY=1e-12))
write = compile_(rotary._rotary_kv_write_kernel,
                 ["*i64", "*fp32", "*fp32", "*bf16", "*bf16", "*fp8e4nv", "*fp8e4nv", "*i64"]
                 + ["i32"] * 9,
                 dict(HEAD_DIM=128, BLOCK_SIZE=16, PAD_H=32, PAD_HKV=8, PAD_D=128, PDL=False,
                      FP8_KV=True, FP8_MAX=448.0, TINY=1e-12))
print("quantize", quantize.count("div.rn.f32") > 0, "write", write.count("div.rn.f32") > 0)
for q in ("bf16", "fp16"):
    ptx = compile_(decode_attention._decode_kernel,
                   [f"*{q}", "*fp8e4nv", "*fp8e4nv", "*i64", "*i32", f"*{q}", "*fp32", "*fp32",
                    "*i64", "*fp32", "*fp32", "*i64", "fp32"] + ["i32"] * 13,
                   dict(GROUP=4, PAD_G=16, HEAD_DIM=128, PAD_D=128, BLOCK_SIZE=16, BLOCK_N=128,
                        NUM_SPLITS=2, PRECISION="tf32", FROM_QKV=False, PDL=False, FP8_KV=True))
    print("decode", q, "f16 mma" if "f32.f16.f16.f32" in ptx else "other mma",
          ptx.count("cvt.bf16.f16"))
"""


def test_fp8_kernels_compile_for_hopper_as_planned() -> None:
    """The quantizing kernels and the decode launch over an FP8 cache, compiled for sm_90 by
    Triton on the CPU (outside the interpreter, which neither compiles nor sees the PTX): the
    quantization divides as IEEE does (div.rn), and the decode's dots are float16 with no
    conversion to bfloat16 (three instructions an element, where e4m3 pairs widen to float16
    in one) for bfloat16 and float16 queries."""
    stdout = compile_outside_interpreter(_SM90_COMPILE)
    assert stdout.split("\n")[:3] == [
        "quantize True write True",
        "decode bf16 f16 mma 0",
        "decode fp16 f16 mma 0",
    ], stdout

"""The block types of GGUF's Q4_K_M files (Q4_K, Q6_K, Q5_0) in the native block kernels: the
torch reference and the kernels' lookups bit-identical to gguf's numpy dequantize, on random
blocks and on the real tensors of the embedded Gemma 3 270M file; products on every
instruction set against the dequantized weights; Q5_0 widened to Q8_0 without a changed bit;
the weight plan that keeps Gemma's tensors packed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from splitserve.engine.config import EngineConfig
from splitserve.engine.gguf_file import read_gguf
from splitserve.engine.layers.attention_backends import make_backend
from splitserve.engine.loader import load_model_config, resolve_model
from splitserve.engine.models.registry import model_class
from splitserve.engine.weight_format import block_weight_plan
from splitserve.kernels.native.blocks import (
    BLOCK_BYTES,
    ISAS,
    Q4_0,
    Q4_K,
    Q5_0,
    Q6_K,
    Q8_0,
    best_isa,
    block_matmul,
    dequantize_ref,
    dequantize_rows,
    interleave,
    native_available,
    one_row_error_bound,
    rounds_one_row,
    to_q8_0,
)
from tests.support.blocks import random_blocks

pytestmark = pytest.mark.skipif(not native_available(), reason="no C compiler here")

TYPES = (Q5_0, Q4_K, Q6_K)
GGML = {q: GGMLQuantizationType(q) for q in (Q4_0, Q5_0, Q8_0, Q4_K, Q6_K)}


def gguf_reference(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    return torch.from_numpy(dequantize(blocks.numpy(), GGML[qtype]))


@pytest.fixture(scope="module")
def gemma_tensors() -> dict[int, list[torch.Tensor]]:
    """The first 48 rows of each of Gemma 3 270M's tensors, by type."""
    out: dict[int, list[torch.Tensor]] = {}
    for tensor in read_gguf(resolve_model("gemma3-270m")).tensors:
        if int(tensor.tensor_type) in GGML:
            out.setdefault(int(tensor.tensor_type), []).append(
                torch.from_numpy(np.array(tensor.data[:48]))
            )
    return out


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_ref_and_lookups_are_bit_identical_to_gguf_on_random_blocks(
    qtype: int,
) -> None:
    blocks = random_blocks(qtype, 24, 512)
    reference = gguf_reference(blocks, qtype)
    assert reference.isfinite().all()
    assert torch.equal(dequantize_ref(blocks, qtype), reference)
    ids = torch.tensor([5, 0, 23, 5])
    assert torch.equal(dequantize_rows(blocks, qtype, ids), reference[ids])


def test_dequantize_ref_and_lookups_are_bit_identical_to_gguf_on_gemma(
    gemma_tensors: dict[int, list[torch.Tensor]],
) -> None:
    assert sorted(gemma_tensors) == [Q5_0, Q8_0, Q4_K, Q6_K]
    for qtype, tensors in gemma_tensors.items():
        for blocks in tensors:
            reference = gguf_reference(blocks, qtype)
            assert torch.equal(dequantize_ref(blocks, qtype), reference)
            ids = torch.tensor([47, 0, 13])
            assert torch.equal(dequantize_rows(blocks, qtype, ids), reference[ids])


def _check_products(blocks: torch.Tensor, qtype: int, isa: str, seed: int) -> None:
    """Products at 1-13 rows against float64 ones with the dequantized weights (one row on
    AVX-512 within the bound of its 16-bit rounding), and one-hot rows of x returning the very
    weights gguf dequantizes."""
    reference = gguf_reference(blocks, qtype)
    inputs = reference.shape[1]
    gen = torch.Generator().manual_seed(seed)
    for rows in (1, 2, 3, 8, 13):
        x = torch.randn(rows, inputs, generator=gen)
        out = block_matmul(x, blocks, qtype, isa)
        expected = x.double() @ reference.double().T
        scale = float(reference.abs().max()) * inputs**0.5
        if rows == 1 and rounds_one_row(qtype, isa):  # x rounded to 16 bits (blocks_row16.c)
            bound = one_row_error_bound(x[0], reference)
            assert ((out[0].double() - expected[0]).abs() <= bound + 1e-6 * scale).all()
        else:
            torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6 * scale)
        picks = torch.randint(0, inputs, (rows,), generator=gen)
        picks[0] = inputs - 1
        ones = torch.eye(inputs)[picks]
        assert torch.equal(block_matmul(ones, blocks, qtype, isa), reference[:, picks].T)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("isa", ISAS)
def test_block_matmul_sees_gguf_weights_on_every_path(qtype: int, isa: str) -> None:
    _check_products(random_blocks(qtype, 37, 512, seed=qtype), qtype, isa, seed=qtype)


@pytest.mark.parametrize("isa", ISAS)
def test_block_matmul_sees_gguf_weights_of_gemma(
    gemma_tensors: dict[int, list[torch.Tensor]], isa: str
) -> None:
    for qtype in TYPES:
        _check_products(gemma_tensors[qtype][0], qtype, isa, seed=1)


@pytest.mark.skipif(best_isa() < ISAS.index("avx512"), reason="this CPU has no AVX-512F")
@pytest.mark.parametrize("qtype", TYPES)
def test_avx512_takes_the_one_output_passes_at_many_rows(qtype: int) -> None:
    # No interleaved copy for these types: 20 rows run as passes of 8, 8 and 4.
    blocks = random_blocks(qtype, 45, 768, seed=4)
    assert interleave(blocks, qtype) is None
    reference = gguf_reference(blocks, qtype).double()
    x = torch.randn(20, 768, generator=torch.Generator().manual_seed(5))
    out = block_matmul(x, blocks, qtype, "avx512", interleaved=None)
    atol = 1e-6 * float(reference.abs().max()) * 768**0.5
    torch.testing.assert_close(out.double(), x.double() @ reference.T, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("qtype", [Q4_0, Q5_0])
def test_to_q8_0_keeps_every_weight(qtype: int) -> None:
    blocks = random_blocks(qtype, 9, 96, seed=2)
    wide = to_q8_0(blocks, qtype)
    assert wide.shape == (9, 3 * BLOCK_BYTES[Q8_0])
    assert torch.equal(gguf_reference(wide, Q8_0), gguf_reference(blocks, qtype))
    with pytest.raises(ValueError, match="Q4_K blocks do not widen"):
        to_q8_0(random_blocks(Q4_K, 1, 256), Q4_K)


def test_the_plan_keeps_every_gemma_projection_packed() -> None:
    path = resolve_model("gemma3-270m")
    cfg = load_model_config(path)
    with torch.device("meta"):
        model = model_class(cfg)(cfg, make_backend("torch", 4, 1, 256))
    plan = block_weight_plan(EngineConfig(model=path), path, model, cfg.tie_word_embeddings)
    kinds: dict[str, set[int]] = {}
    for name, qtype in plan.types.items():
        kinds.setdefault(name.split(".")[-2], set()).add(qtype)
    # q|k|v mixes Q5_0 with Q8_0 in half the layers: those widen to Q8_0.
    assert kinds == {
        "embed_tokens": {Q8_0},
        "qkv_proj": {Q5_0, Q8_0},
        "o_proj": {Q4_K},
        "gate_up_proj": {Q5_0},
        "down_proj": {Q4_K, Q6_K},
    }
    assert len(plan.types) == 1 + 4 * 18
    assert set(plan.widen.values()) == {Q5_0} and len(plan.widen) == 2 * 9

"""Deterministic mode's kernels: every row the same bits alone or among others."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from splitserve import LLM, SamplingParams
from splitserve.engine.layers.attention_backends import make_backend
from splitserve.engine.layers.batch_invariant_kernels import make_kernels_invariant
from splitserve.engine.layers.invariant_attention import InvariantAttention
from splitserve.engine.layers.moe import SparseMoE
from splitserve.engine.layers.norm import RMSNorm
from splitserve.engine.model_config import MoEConfig
from splitserve.engine.models.registry import model_class
from splitserve.engine.request import RequestOutput
from splitserve.engine.shapes import shape_config
from splitserve.engine.spec.config import SpeculativeConfig
from splitserve.kernels import invariant_attention as invariant_attention_module
from splitserve.kernels.decode_attention import paged_decode_attention_ref
from splitserve.kernels.dispatch import set_kernels_on_cpu
from splitserve.kernels.invariant_attention import invariant_attention, prefill_tiles
from splitserve.kernels.invariant_matmul import (
    invariant_matmul,
    invariant_matmul_ref,
    num_splits,
)

# Triton's interpreter computes bfloat16 dots on raw bits: bfloat16 runs on the GPU only.
TOL = {torch.float32: 1e-4, torch.float16: 2e-2}


@pytest.fixture(autouse=True)
def row_independent_dots(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter's ``tl.dot`` is numpy's matmul, and OpenBLAS's sgemm on an AVX2-only
    CPU (Haswell kernels) sums a row in another order at another place in the tile, so there
    no kernel's rows could be equal. On the GPU each output of an MMA is one sum whatever the
    other rows hold; here the dots take numpy's pairwise sum over K of the products (the same
    for every row at every place), so that the tests check the kernels' own order."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    plain = builder.create_dot

    def create_dot(self: Any, a: Any, b: Any, d: Any, precision: Any, imprecise: Any) -> Any:
        if a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating():
            return plain(self, a, b, d, precision, imprecise)
        dtype = d.data.dtype
        products = a.data.astype(dtype)[..., :, :, None] * b.data.astype(dtype)[..., None, :, :]
        return interpreter.TensorHandle(products.sum(axis=-2) + d.data, d.dtype.scalar)

    monkeypatch.setattr(builder, "create_dot", create_dot)


@pytest.mark.parametrize(
    ("n", "k", "bias", "dtype"),
    [
        (192, 256, True, torch.float32),
        (192, 1024, False, torch.float16),
        (130, 1000, True, torch.float32),
    ],
)
def test_invariant_matmul_rows_equal_alone_and_batched(
    n: int, k: int, bias: bool, dtype: torch.dtype
) -> None:
    torch.manual_seed(n + k)
    x = torch.randn(70, k, dtype=dtype)
    weight = torch.randn(n, k, dtype=dtype) / k**0.5
    b = torch.randn(n, dtype=dtype) if bias else None
    full = invariant_matmul(x, weight, b)
    torch.testing.assert_close(
        full.float(), invariant_matmul_ref(x, weight, b), atol=TOL[dtype], rtol=TOL[dtype]
    )
    for row in (0, 37, 69):
        assert torch.equal(invariant_matmul(x[row : row + 1], weight, b)[0], full[row])
    assert torch.equal(invariant_matmul(x[5:40], weight, b), full[5:40])
    for parallel in (False, True):  # the splits as programs of their own or in turn
        assert torch.equal(invariant_matmul(x, weight, b, parallel_splits=parallel), full)


def test_invariant_matmul_split_count_reads_only_the_weight_shape() -> None:
    assert num_splits(192, 256) == 1
    assert num_splits(192, 1024) == 2
    assert num_splits(4096, 4096) == 4  # Llama-3-8B o_proj: 32 column tiles x 4
    assert num_splits(4096, 14336) == 4
    assert num_splits(28672, 4096) == 1


def _attend(
    q: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor],
    decodes: list[tuple[torch.Tensor, int]],
    chunks: list[tuple[torch.Tensor, int, int]],
    parallel: bool | None = None,
) -> torch.Tensor:
    """invariant_attention over decode rows (table, context length) then prompt chunks (table,
    new tokens, context length); q holds their rows in that order."""
    width = max(t.shape[0] for t, *_ in decodes + chunks)  # type: ignore[operator]
    pad = [torch.nn.functional.pad(t, (0, width - t.shape[0])) for t, *_ in decodes + chunks]
    tables = torch.stack(pad) if pad else torch.zeros(0, 1, dtype=torch.long)
    segments, row = [], len(decodes)
    for _, length, context in chunks:
        segments.append((row, length, context))
        row += length
    tiles = prefill_tiles(segments, q.shape[1] // cache[0].shape[2], q.device)
    lens = torch.tensor([n for _, n in decodes], dtype=torch.long)
    d = len(decodes)
    scale = q.shape[2] ** -0.5
    return invariant_attention(q, *cache, tables[:d], lens, tiles, tables[d:], scale, parallel)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dtype"), [(8, 2, torch.float32), (6, 2, torch.float16)]
)
def test_invariant_attention_rows_equal_as_decode_prefill_cached_or_batched(
    heads: int, kv_heads: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Smaller key tiles and splits than on the GPU, for the interpreter's sake: 150 positions
    # cross two split boundaries.
    monkeypatch.setattr(invariant_attention_module, "BLOCK_N", 16)
    monkeypatch.setattr(invariant_attention_module, "KV_SPLIT", 64)
    torch.manual_seed(heads)
    dim, block, length = 32, 16, 150
    blocks = torch.randperm(24)
    table = blocks[: -(-length // block)]
    other = blocks[20:24]  # a second sequence of 50 tokens
    cache = (torch.randn(24, block, kv_heads, dim, dtype=dtype),
             torch.randn(24, block, kv_heads, dim, dtype=dtype))  # fmt: skip
    q = torch.randn(length, heads, dim, dtype=dtype)
    q_other = torch.randn(50, heads, dim, dtype=dtype)

    whole = _attend(q, cache, [], [(table, length, length)])
    rows = torch.arange(length)
    ref = paged_decode_attention_ref(
        q, *cache, table.expand(length, -1), rows + 1, dim**-0.5
    )  # every row as a decode row of its own context
    torch.testing.assert_close(whole.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])

    # Chunked: the first 100 positions, then the rest over their cached prefix beside a decode
    # row and another sequence's prompt.
    first = _attend(q[:70], cache, [], [(table, 70, 70)])
    mixed = torch.cat([q_other[49:50], q[70:], q_other[:30]])
    second = _attend(mixed, cache, [(other, 50)], [(table, 80, length), (other, 30, 30)])
    assert torch.equal(first, whole[:70])
    assert torch.equal(second[1:81], whole[70:])

    # Decode rows alone and batched give the prompt rows' bits, their splits run as programs
    # of their own and merged by a second launch, or in turn in one program.
    picks = [0, 63, 64, 128, 149]
    for parallel in (True, False):
        for p in picks:
            alone = _attend(q[p : p + 1], cache, [(table, p + 1)], [], parallel)
            assert torch.equal(alone[0], whole[p])
        batched = _attend(q[picks], cache, [(table, p + 1) for p in picks], [], parallel)
        assert torch.equal(batched, whole[picks])


def _bits(out: RequestOutput) -> list[tuple[int, list[tuple[int, float]]]]:
    completion = out.outputs[0]
    assert completion.logprobs is not None
    return [
        (token, sorted((t, e.logprob) for t, e in entries.items()))
        for token, entries in zip(completion.token_ids, completion.logprobs)
    ]


def test_deterministic_engine_on_the_kernels_gives_a_probe_the_same_bits_anywhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The whole wiring (``batch_invariant_kernels.py``) on tiny-llama through the interpreter:
    a probe alone, then cached and chunked among other prompts, then beside drafts verified.
    Splits of 16 keys: a prompt row merges up to three in a program."""
    monkeypatch.setattr(invariant_attention_module, "BLOCK_N", 16)
    monkeypatch.setattr(invariant_attention_module, "KV_SPLIT", 16)
    gen = torch.Generator().manual_seed(0)
    probe = torch.randint(3, 500, (32,), generator=gen).tolist()
    others = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 20)]
    greedy = SamplingParams(max_tokens=3, temperature=0, logprobs=1, ignore_eos=True)
    common: dict[str, Any] = dict(
        model="shape:tiny-llama", deterministic=True, attention_backend="triton",
        block_size=16, max_model_len=128, num_kv_blocks=48,
    )  # fmt: skip
    set_kernels_on_cpu(True)
    try:
        llm = LLM(max_num_batched_tokens=24, **common)
        assert type(llm.engine.runner.model.layers[0].self_attn.backend) is InvariantAttention
        alone = llm.generate([probe], greedy, use_tqdm=False)[0]
        cached = llm.generate([*others, probe], greedy, use_tqdm=False)[-1]
        # A draft of the target's shape and seed is the target: every draft is accepted, and
        # each verify step computes 3 + 1 rows of the probe; their splits in turn, where the
        # runs above ran a decode row's as programs of their own.
        monkeypatch.setattr(invariant_attention_module, "TARGET_PROGRAMS", 0)
        spec = SpeculativeConfig("draft_model", 3, model="shape:tiny-llama", dynamic=False)
        drafting = LLM(enable_prefix_caching=False, speculative=spec, **common)
        drafted = drafting.generate([others[0], probe], greedy, use_tqdm=False)[-1]
    finally:
        set_kernels_on_cpu(False)
    assert alone.num_cached_tokens == 0 and cached.num_cached_tokens > 0
    assert _bits(cached) == _bits(alone)
    assert _bits(drafted) == _bits(alone)
    assert drafting.engine.stats().spec_num_accepted_tokens > 0


def test_invariant_moe_layer_rows_equal_alone_and_batched() -> None:
    """Fixed grouped-GEMM tiles and the ordered combine: 70 tokens (140 pairs: torch's
    permutation, past the kernels') and one token (the permute kernel) give a token the same
    bits; the default tiles are checked against the torch code elsewhere."""
    torch.manual_seed(0)
    moe = SparseMoE(32, MoEConfig(num_experts=6, top_k=2, intermediate_size=24, renormalize=True))
    moe.invariant = True
    norm = RMSNorm(32, 1e-6)
    x, residual = torch.randn(70, 32), torch.randn(70, 32)
    set_kernels_on_cpu(True)
    try:
        with torch.no_grad():
            full = moe(x, residual, norm)[0]
            alone = [moe(x[i : i + 1], residual[i : i + 1], norm)[0][0] for i in (0, 33, 69)]
            part = moe(x[10:30], residual[10:30], norm)[0]
    finally:
        set_kernels_on_cpu(False)
    assert all(torch.equal(row, full[i]) for row, i in zip(alone, (0, 33, 69)))
    assert torch.equal(part, full[10:30])
    with torch.no_grad():
        torch.testing.assert_close(full, moe(x, residual, norm)[0], atol=1e-5, rtol=1e-5)


def test_deterministic_mode_on_the_kernels_refuses_what_it_does_not_cover() -> None:
    cfg = shape_config("tiny-mixtral")
    backend = make_backend("triton", cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    mixtral = model_class(cfg)(cfg, backend)
    make_kernels_invariant(mixtral)
    assert all(m.invariant for m in mixtral.modules() if isinstance(m, SparseMoE))
    cfg = shape_config("tiny-llama")
    torch_backend = make_backend("torch", cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    model = model_class(cfg)(cfg, torch_backend)
    attn = model.layers[0].self_attn
    attn.backend = attn.backend.configured(None, sliding_window=128)  # Gemma 3's local layers
    with pytest.raises(ValueError, match="sliding-window"):
        make_kernels_invariant(model)

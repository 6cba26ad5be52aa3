"""The native CPU kernels (splitserve/kernels/native/) against their torch references."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from splitserve.engine.layers.activation import silu_and_mul
from splitserve.engine.layers.attention import AttentionMetadata, PrefillSegment, TorchAttention
from splitserve.engine.layers.norm import RMSNorm
from splitserve.engine.layers.rotary import RotaryEmbedding
from splitserve.kernels.native import build
from splitserve.kernels.native import decode as native
from splitserve.kernels.native.blocks import (
    ISAS,
    Q4_0,
    Q4_1,
    Q8_0,
    best_isa,
    block_matmul,
    dequantize_ref,
    dequantize_rows,
    interleave,
    native_available,
    native_isa,
    one_row_error_bound,
    rounds_one_row,
    set_native_isa,
)

pytestmark = pytest.mark.skipif(not native_available(), reason="no C compiler here")

GGML = {Q4_0: GGMLQuantizationType.Q4_0, Q4_1: GGMLQuantizationType.Q4_1,
        Q8_0: GGMLQuantizationType.Q8_0}  # fmt: skip


def _blocks(qtype: int, rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    weights = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    packed = quantize(weights, GGML[qtype])
    return torch.from_numpy(packed.copy()), dequantize(packed, GGML[qtype])


@pytest.mark.parametrize("qtype", [Q4_0, Q4_1, Q8_0])
def test_dequantize_ref_is_bit_identical_to_gguf_numpy(qtype: int) -> None:
    blocks, reference = _blocks(qtype, 24, 96)
    assert torch.equal(dequantize_ref(blocks, qtype), torch.from_numpy(reference))
    rows = dequantize_rows(blocks, qtype, torch.tensor([5, 0, 23, 5]))
    assert torch.equal(rows, torch.from_numpy(reference[[5, 0, 23, 5]]))


@pytest.mark.parametrize("qtype", [Q4_0, Q4_1, Q8_0])
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
@pytest.mark.parametrize("isa", ISAS)
def test_block_matmul_equals_the_product_with_the_dequantized_weight(
    qtype: int, rows: int, isa: str
) -> None:
    blocks, reference = _blocks(qtype, 40, 160, seed=rows)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    out = block_matmul(x, blocks, qtype, isa)
    expected = x.double() @ torch.from_numpy(reference).double().T
    assert out.shape == (rows, 40)
    if rows == 1 and rounds_one_row(qtype, isa):  # x rounded to 16 bits (blocks_row16.c)
        bound = one_row_error_bound(x[0], torch.from_numpy(reference))
        assert ((out[0].double() - expected[0]).abs() <= bound + 1e-5).all()
    else:
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=2e-5)


@pytest.mark.skipif(best_isa() < ISAS.index("avx512"), reason="this CPU has no AVX-512F")
@pytest.mark.parametrize("qtype", [Q4_0, Q4_1, Q8_0])
def test_avx512_products_see_the_same_weights_as_avx2_and_portable(qtype: int) -> None:
    # One-hot rows of x pick single weights out of the product: every path must return the
    # dequantized weights bit for bit (only sums of several products may differ in order).
    blocks, reference = _blocks(qtype, 37, 224, seed=3)
    picks = torch.eye(224)[[0, 1, 15, 16, 17, 31, 32, 100, 223]]
    for isa in ISAS:
        for rows in (1, 2, 3, 9):
            out = block_matmul(picks[:rows].contiguous(), blocks, qtype, isa)
            assert torch.equal(out, torch.from_numpy(reference)[:, picks[:rows].argmax(1)].T)
    x = torch.randn(13, 224, generator=torch.Generator().manual_seed(5))
    by_isa = {isa: block_matmul(x, blocks, qtype, isa) for isa in ISAS}
    torch.testing.assert_close(by_isa["avx512"], by_isa["avx2"], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(by_isa["avx512"], by_isa["portable"], rtol=1e-5, atol=2e-5)


@pytest.mark.skipif(best_isa() < ISAS.index("avx512"), reason="this CPU has no AVX-512F")
@pytest.mark.parametrize("qtype", [Q4_0, Q4_1, Q8_0])
@pytest.mark.parametrize("rows", [2, 8, 13, 32])
@pytest.mark.parametrize("outputs", [16, 40, 100])
@pytest.mark.parametrize("inputs", [160, 416])
def test_the_interleaved_copy_gives_the_product_with_the_dequantized_weight(
    qtype: int, rows: int, outputs: int, inputs: int
) -> None:
    # 16 outputs: one group padded to a pair; 40: a pair and a partial one; 13 rows: uneven
    # passes; from 8 rows (Q8_0) or 16 the dequantized panel, 416 inputs in three pieces of it.
    blocks, reference = _blocks(qtype, outputs, inputs, seed=rows + outputs)
    il = interleave(blocks, qtype)
    assert il is not None
    x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(rows))
    out = block_matmul(x, blocks, qtype, "avx512", interleaved=il)
    expected = x.double() @ torch.from_numpy(reference).double().T
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=2e-5)
    # Each sum is one chain in a fixed order, whichever interleaved kernel the row count takes
    # (Q8_0 takes the copy from 8 rows).
    head = min(rows, 8 if qtype == Q8_0 else 2)
    first = block_matmul(x[:head].contiguous(), blocks, qtype, "avx512", interleaved=il)
    assert torch.equal(out[:head], first)
    # One-hot rows pick single weights: the interleaved kernel sees gguf's weights bit for bit.
    picks = torch.tensor([0, 1, 15, 16, 17, 31, 32, 100, 159, 2, 3, 64, 65, inputs - 1])
    ones = torch.eye(inputs)[picks[torch.arange(max(rows, 8)) % len(picks)]]
    out = block_matmul(ones, blocks, qtype, "avx512", interleaved=il)
    assert torch.equal(out, torch.from_numpy(reference)[:, ones.argmax(1)].T)


def test_no_interleaved_copy_below_avx512() -> None:
    blocks, _ = _blocks(Q4_1, 16, 64)
    set_native_isa("avx2")
    try:
        assert interleave(blocks, Q4_1) is None
    finally:
        set_native_isa(None)


def test_native_isa_is_capped_by_the_setting_and_by_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SPLITSERVE_NATIVE_ISA", raising=False)
    try:
        set_native_isa(None)
        assert native_isa() == ISAS[best_isa()]
        set_native_isa("portable")
        assert native_isa() == "portable"
        monkeypatch.setenv("SPLITSERVE_NATIVE_ISA", "avx2")
        set_native_isa(None)
        assert native_isa() == ISAS[min(1, best_isa())]
        with pytest.raises(ValueError, match="one of portable, avx2, avx512"):
            set_native_isa("sse2")
    finally:
        set_native_isa(None)


def test_block_matmul_refuses_a_mismatched_input() -> None:
    blocks, _ = _blocks(Q4_1, 8, 64)
    with pytest.raises(ValueError, match="float32"):
        block_matmul(torch.randn(2, 32), blocks, Q4_1)


def test_add_rms_norm_matches_the_torch_norm() -> None:
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = torch.rand(96) + 0.5
    x, residual = torch.randn(5, 96), torch.randn(5, 96)
    native.set_native_enabled(False)
    try:
        ref_out, ref_sum = norm.add_and_norm(x, residual)
        ref_alone = norm(x)
    finally:
        native.set_native_enabled(True)
    out, summed = norm.add_and_norm(x, residual)
    assert torch.equal(summed, ref_sum)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(norm(x), ref_alone, rtol=1e-6, atol=1e-6)


def test_silu_and_mul_matches_torch() -> None:
    """16 lanes at a time and the tail (I = 88), gates far out on both sides among them."""
    x = torch.randn(3, 2 * 88) * 4
    x[0, :8] = torch.tensor([-200.0, -90.0, -87.0, -20.0, 20.0, 87.0, 90.0, 200.0])
    native.set_native_enabled(False)
    try:
        reference = silu_and_mul(x)
    finally:
        native.set_native_enabled(True)
    torch.testing.assert_close(silu_and_mul(x), reference, rtol=1e-6, atol=1e-6)


def _decode_case(
    context_lens: list[int], block_size: int = 16, shape: tuple[int, int, int] = (6, 2, 32)
) -> tuple:
    heads, kv_heads, dim = shape
    gen = torch.Generator().manual_seed(7)
    num_blocks = 20
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-n // block_size) for n in context_lens) + 1  # one padding column
    tables, slots, start = [], [], 0
    for n in context_lens:
        count = -(-n // block_size)
        table = order[start : start + count]
        start += count
        slots.append(table[(n - 1) // block_size] * block_size + (n - 1) % block_size)
        tables.append(table + [0] * (width - count))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decode_tokens=len(context_lens),
        decode_block_tables=torch.tensor(tables),
        decode_context_lens=torch.tensor(context_lens),
        prefills=[],
    )
    qkv = torch.randn(len(context_lens), (heads + 2 * kv_heads) * dim, generator=gen)
    positions = torch.tensor(context_lens) - 1
    rotary = RotaryEmbedding(dim, 256, 10000.0, None)
    return TorchAttention(heads, kv_heads, dim), qkv, positions, rotary, cache, meta


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One OpenMP thread (the kernels share torch's libgomp): a decode batch of two or more
    sequences then takes the task of a sequence with all its KV heads, a single sequence one
    KV head per task, whatever the machine's core count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("context_lens", [[1], [37, 5, 16], [130, 64]])
@pytest.mark.parametrize(
    "shape",
    [(6, 2, 32), (9, 3, 64), (8, 1, 128), (4, 2, 48), (10, 2, 40), (2, 2, 320)],
    ids=["g3-d32", "smollm2-g3-d64", "g8-d128", "g2-d48", "g5-d40-any", "g1-d320"],
)
@pytest.mark.parametrize("window", [None, 20], ids=["whole", "window-20"])
def test_native_decode_attention_matches_torch_and_writes_the_same_cache(
    context_lens: list[int], shape: tuple[int, int, int], window: int | None, one_thread: None
) -> None:
    """Query heads per KV head and head sizes: the V sum's unrolled shapes (SmolLM2's), its
    general loop (by two heads and four 16-float slices), and a head size not a multiple of
    16 (attend_any); each over the whole context and over a sliding window of 20 tokens
    (Gemma 3's local layers), which starts inside a block."""
    backend, qkv, positions, rotary, cache, meta = _decode_case(context_lens, shape=shape)
    backend = backend.configured(None, window)
    ref_cache = cache.clone()
    native.set_native_enabled(False)
    try:
        reference = backend.forward_qkv(qkv, positions, rotary, ref_cache[0], ref_cache[1], meta)
    finally:
        native.set_native_enabled(True)
    out = backend.forward_qkv(qkv, positions, rotary, cache[0], cache[1], meta)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache, ref_cache, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "shape",
    [(9, 3, 64), (8, 1, 128), (6, 2, 32), (4, 2, 48), (2, 2, 320)],
    ids=["smollm2-g3-d64", "g8-d128", "g3-d32", "g2-d48", "g1-d320"],
)
@pytest.mark.parametrize("window", [None, 20], ids=["whole", "window-20"])
def test_decode_attention_in_8_and_16_float_vectors_gives_the_same_bits(
    shape: tuple[int, int, int], window: int | None, one_thread: None
) -> None:
    """Without AVX-512 the scores and V sums run in 8-float vectors (16-float ones went through
    memory there); the sums are the same in the same order, so the bits are too: forced
    either way on any CPU, the outputs and the caches written are equal."""
    results = []
    try:
        for lanes in (16, 8):
            native.set_attention_lanes(lanes)
            backend, qkv, positions, rotary, cache, meta = _decode_case([37, 5, 130], shape=shape)
            backend = backend.configured(None, window)
            out = backend.forward_qkv(qkv, positions, rotary, cache[0], cache[1], meta)
            results.append((out, cache))
    finally:
        native.set_attention_lanes(0)
    (wide, wide_cache), (narrow, narrow_cache) = results
    assert torch.equal(wide, narrow)
    assert torch.equal(wide_cache, narrow_cache)
    assert not torch.equal(wide, torch.zeros_like(wide))


def test_a_sequences_attention_is_the_same_bits_alone_and_in_a_batch(one_thread: None) -> None:
    """In a batch of at least two sequences per thread a task is a sequence with all its KV
    heads (its blocks read whole), alone it is one KV head: the sums run in the same order
    either way, so each row's output is bit for bit the same (batch invariance)."""
    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(3)
    lens = [37, 5, 16, 130, 64, 1, 17, 200]
    per_seq = -(-max(lens) // block_size)
    k_cache = torch.randn(len(lens) * per_seq, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(len(lens) * per_seq, generator=gen).view(len(lens), per_seq)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * dim, generator=gen)
    positions = torch.tensor(lens) - 1
    slots = tables[torch.arange(len(lens)), positions // block_size] * block_size
    slots += positions % block_size
    angles = torch.arange(256)[:, None] * torch.rand(dim, generator=gen)
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()

    def attend(rows: slice) -> torch.Tensor:
        out = torch.empty(len(lens[rows]), heads, dim)
        native.decode_attention(
            qkv[rows], positions[rows], cos, sin, k_cache, v_cache, slots[rows],
            tables[rows], positions[rows] + 1, heads, dim**-0.5, out,
        )  # fmt: skip
        return out

    batch = attend(slice(None))
    for i in range(len(lens)):
        assert torch.equal(attend(slice(i, i + 1))[0], batch[i]), f"sequence {i}"


def test_a_kv_heads_query_heads_split_over_threads_give_the_same_bits() -> None:
    """Fewer (sequence, KV head) tasks than threads (Gemma 3's one KV head at batch 1): each
    thread takes a share of the query heads, and every head's sums are those of one thread."""
    heads, kv_heads, dim, block_size = 4, 1, 256, 16
    gen = torch.Generator().manual_seed(4)
    k_cache = torch.randn(12, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(12, generator=gen)[None, :11]
    qkv = torch.randn(1, (heads + 2 * kv_heads) * dim, generator=gen)
    positions = torch.tensor([170])
    slots = tables[0, 170 // block_size] * block_size + 170 % block_size
    angles = torch.arange(256)[:, None] * torch.rand(dim, generator=gen)
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    outs = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            out = torch.empty(1, heads, dim)
            native.decode_attention(
                qkv, positions, cos, sin, k_cache, v_cache, slots.view(1), tables,
                positions + 1, heads, dim**-0.5, out, 100,
            )  # fmt: skip
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize(
    "shape",
    [(9, 3, 64), (8, 1, 128), (6, 2, 32), (16, 2, 256)],
    ids=["smollm2-g3-d64", "g8-d128", "g3-d32", "g8-d256"],
)
@pytest.mark.parametrize("block_size", [16, 8, 32])
def test_a_sequences_rows_in_one_call_are_the_one_row_kernels_rows_bit_for_bit(
    shape: tuple[int, int, int], block_size: int, one_thread: None
) -> None:
    """Runs of 8 or more rows of one sequence in one call (a prompt chunk laid out as decode
    rows in deterministic mode, a verify step's rows) take decode_rows.c, several rows per
    pass over 16-key tiles; each row's output is the same bits as that row alone (decode.c's
    one-row walk). A's 45 prompt rows in chunks of 1, 19 and 25 (contexts 1 to 45: not
    multiples of the tile or the block), B's 11 rows after a cached prefix of 37 tokens and
    C's one decode row at 70 in the same call as A's last chunk. In 16-float vectors, which
    runs need, on any CPU."""
    heads, kv_heads, dim = shape
    gen = torch.Generator().manual_seed(block_size + dim)
    blocks = 3 * -(-70 // block_size)
    k_cache = torch.randn(blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(blocks, generator=gen).view(3, -1)
    rows = [(0, p) for p in range(45)] + [(1, p) for p in range(37, 48)] + [(2, 69)]
    seq = torch.tensor([s for s, _ in rows])
    positions = torch.tensor([p for _, p in rows])
    slots = tables[seq, positions // block_size] * block_size + positions % block_size
    qkv = torch.randn(len(rows), (heads + 2 * kv_heads) * dim, generator=gen)
    angles = torch.arange(128)[:, None] * torch.rand(dim, generator=gen)
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()

    def attend(calls: list[list[int]]) -> torch.Tensor:
        caches = k_cache.clone(), v_cache.clone()
        out = torch.empty(len(rows), heads, dim)
        for call in calls:
            at = torch.tensor(call)
            part = torch.empty(len(call), heads, dim)
            native.decode_attention(
                qkv[at], positions[at], cos, sin, *caches, slots[at], tables[seq[at]],
                positions[at] + 1, heads, dim**-0.5, part,
            )  # fmt: skip
            out[at] = part
        return out

    try:
        native.set_attention_lanes(16)
        alone = attend([[i] for i in range(len(rows))])
        together = attend([[0], list(range(1, 20)), list(range(20, len(rows)))])
    finally:
        native.set_attention_lanes(0)
    for i, (s, p) in enumerate(rows):
        assert torch.equal(together[i], alone[i]), f"sequence {s}, position {p}"


def test_build_caches_the_library_by_source(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The suite's own build (the cache that every native test loads from) is found again,
    not rebuilt; other flags (as an edited source) key another folder. Compiling into a
    fresh folder took 16 s of the suite; the first native test of a fresh clone does that."""
    first = build.build()
    assert first.exists() and first.parent.parent == build.cache_root()
    stamp = first.stat().st_mtime_ns
    assert build.build() == first
    assert first.stat().st_mtime_ns == stamp  # loaded, not rebuilt
    compiler = build._compiler()
    assert compiler is not None
    key = build._build_key(compiler)
    monkeypatch.setattr(build, "FLAGS", [*build.FLAGS, "-DSPLITSERVE_OTHER"])
    assert build._build_key(compiler) != key


def test_build_without_a_compiler_says_so(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="no C compiler"):
        build.build(tmp_path)


def test_native_decode_rows_beside_a_prefill_chunk_match_torch() -> None:
    backend, qkv, positions, rotary, cache, meta = _decode_case([37, 5])
    used = set(meta.decode_block_tables.flatten().tolist())
    block = next(b for b in range(20) if b not in used)
    chunk = torch.randn(5, qkv.shape[1], generator=torch.Generator().manual_seed(3))
    meta.slot_mapping = torch.cat([meta.slot_mapping, block * 16 + torch.arange(3, 8)])
    meta.prefills = [PrefillSegment(2, 5, 8, torch.tensor([block]))]
    qkv = torch.cat([qkv, chunk])
    positions = torch.cat([positions, torch.arange(3, 8)])
    ref_cache = cache.clone()
    native.set_native_enabled(False)
    try:
        reference = backend.forward_qkv(qkv, positions, rotary, ref_cache[0], ref_cache[1], meta)
    finally:
        native.set_native_enabled(True)
    out = backend.forward_qkv(qkv, positions, rotary, cache[0], cache[1], meta)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache, ref_cache, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("length", "context"), [(1, 1), (5, 5), (37, 100), (70, 70)])
@pytest.mark.parametrize(
    "shape",
    [(9, 3, 64), (8, 1, 128), (4, 4, 16), (6, 2, 256)],
    ids=["smollm2-g3-d64", "g8-d128", "g1-d16", "g3-d256"],
)
def test_native_prefill_attention_matches_torch(
    length: int, context: int, shape: tuple[int, int, int]
) -> None:
    """A chunk alone and after a cached prefix (37 queries over 100 keys), over one and
    several 32-key blocks and 8-row tasks; the value pass's four- and two-vector shapes and
    its general one."""
    heads, kv_heads, dim = shape
    gen = torch.Generator().manual_seed(length + context)
    q = torch.randn(length, heads, dim, generator=gen)
    k, v = (torch.randn(context, kv_heads, dim, generator=gen) for _ in range(2))
    scale = dim**-0.5
    out = native.prefill_attention(q, k, v, scale)
    assert out is not None
    # In float64: query i (position context - length + i) sees keys 0 to its position.
    group = heads // kv_heads
    seen = torch.arange(context)[None, :] <= torch.arange(length)[:, None] + context - length
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(0, 1),
        k.double().repeat_interleave(group, 1).transpose(0, 1),
        v.double().repeat_interleave(group, 1).transpose(0, 1),
        attn_mask=seen,
        scale=scale,
    ).transpose(0, 1)
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-5)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # each task computes whole rows: the same bits on any number of threads
        assert torch.equal(native.prefill_attention(q, k, v, scale), out)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("shape", [(10, 2, 40), (9, 1, 64)], ids=["d40", "g9"])
def test_native_prefill_attention_leaves_other_shapes_to_torch(shape: tuple[int, int, int]) -> None:
    heads, kv_heads, dim = shape
    q, k = torch.randn(4, heads, dim), torch.randn(4, kv_heads, dim)
    assert native.prefill_attention(q, k, k, 0.1) is None

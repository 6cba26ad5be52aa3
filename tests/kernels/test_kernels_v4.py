"""DeepSeek-V4's decode attention kernel against the engine's torch reference, through Triton's
interpreter: a sliding layer, an HCA layer (entries of 8 tokens across blocks of 4) and a
CSA layer with index lists (padded with -1), three rows whose windows start inside a block,
one split and several, the caches column views of wider group rows as the engine binds them;
the lightning indexer's scores kernel and its choice (ties to the lower entry); the tiny V4 on
the "triton" backend with its decode rows through both, against the torch backend; and its
decode steps on the kernels reading nothing on the host (CUDA-graph safe)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from splitserve import LLM, SamplingParams
from splitserve.engine.layers import v4_attention, v4_decode
from splitserve.engine.layers.lightning_indexer import choose
from splitserve.engine.layers.lightning_indexer import index_scores as torch_index_scores
from splitserve.engine.layers.v4_decode import decode_reference, held_entries
from splitserve.kernels import dispatch
from splitserve.kernels.dispatch import use_kernels
from splitserve.kernels.v4_decode import v4_decode_attention
from splitserve.kernels.v4_indexer import index_scores, select_topk
from tests.support.hopper_compile import compile_outside_interpreter
from tests.support.tiny_models import tiny_deepseek_v4

DIM, WINDOW, BLOCK = 32, 8, 4
CONTEXTS = [5, 37, 70]


def _group(blocks: int, width: int, column: int, dtype: torch.dtype, gen: torch.Generator):
    """Columns [column, column + width) of a random group tensor [blocks, BLOCK, 1, ...]."""
    rows = torch.randn(blocks, BLOCK, 1, column + width + 3, generator=gen).to(dtype)
    return rows[:, :, 0, column : column + width]


def _tables(counts: list[int], gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Distinct random blocks, counts[i] for row i, padded with block 0; and the blocks used."""
    total = sum(counts) + 1
    ids = torch.randperm(total, generator=gen)[: sum(counts)].split(counts)
    tables = torch.zeros(len(counts), max(counts), dtype=torch.long)
    for row, blocks in enumerate(ids):
        tables[row, : len(blocks)] = blocks
    return tables, total


def _window_rows(gen: torch.Generator, dtype: torch.dtype):
    """The key group's cache and tables as ``kv_groups.window_metadata`` makes them: each
    row's table starts at the block of position context - window."""
    firsts = [max(c - WINDOW, 0) // BLOCK for c in CONTEXTS]
    key_lens = torch.tensor([c - f * BLOCK for c, f in zip(CONTEXTS, firsts, strict=True)])
    tables, blocks = _tables([-(-n // BLOCK) for n in key_lens.tolist()], gen)
    return _group(blocks, DIM, 2, dtype, gen), tables, key_lens


@pytest.mark.parametrize(
    ("kind", "heads", "split", "dtype"),
    [
        ("sliding", 4, 16, torch.float32),
        ("hca", 20, 16, torch.float32),
        ("hca", 4, 256, torch.float16),
        ("csa", 4, 16, torch.float32),
        ("csa", 20, 256, torch.float16),
    ],
)
def test_v4_decode_kernel_matches_the_torch_reference(
    kind: str, heads: int, split: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(heads + split)
    key_cache, key_tables, key_lens = _window_rows(gen, dtype)
    q = torch.randn(len(CONTEXTS), heads, DIM, generator=gen).to(dtype)
    sinks = torch.randn(heads, generator=gen)
    entries, index = None, None
    if kind != "sliding":
        rate, index_dim = (4, 16) if kind == "csa" else (8, 0)
        tables, blocks = _tables([-(-c // BLOCK) for c in CONTEXTS], gen)
        cache = _group(blocks, (DIM + index_dim) // rate, 5, dtype, gen)
        entries = (cache, tables, torch.tensor(CONTEXTS), rate)
    if kind == "csa":
        # the first row has one entry; the others 3 of 9 and of 17; -1 anywhere
        index = torch.tensor([[-1, 0, -1], [7, 2, 4], [-1, 16, 3]])
    got = v4_decode_attention(
        q, key_cache, key_tables, key_lens, sinks, WINDOW, entries, index, split=split, block_n=16
    )
    expected = decode_reference(q, key_cache, key_tables, key_lens, sinks, WINDOW, entries, index)
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


def test_index_scores_and_choice_match_the_torch_indexer() -> None:
    """The scores kernel against the torch path's index_scores on each row's closed entries
    (-inf after them), and its choice of the best 3 equal to the torch path's where no
    scores tie (random ones)."""
    gen = torch.Generator().manual_seed(1)
    rate, heads, index_dim = 4, 16, 16
    tables, blocks = _tables([-(-c // BLOCK) for c in CONTEXTS], gen)
    cache = _group(blocks, (DIM + index_dim) // rate, 5, torch.float32, gen)
    lens = torch.tensor(CONTEXTS)
    q = torch.randn(len(CONTEXTS), heads, index_dim, generator=gen)
    weights = torch.randn(len(CONTEXTS), heads, generator=gen)
    scores = index_scores(q, weights, (cache, tables, lens, rate), DIM, block_n=16)
    assert scores.shape == (3, tables.shape[1] * BLOCK // rate)
    index = select_topk(scores, 3)
    for row, context in enumerate(CONTEXTS):
        count = context // rate
        keys = held_entries(cache, tables[row], count, rate)[:, DIM:]
        expected = torch_index_scores(q[row : row + 1], weights[row : row + 1], keys)[0]
        torch.testing.assert_close(scores[row, :count], expected, rtol=2e-5, atol=2e-5)
        assert torch.isinf(scores[row, count:]).all()
        chosen = choose(expected[None], torch.tensor([count]), 3)[0]
        picked = index[row][index[row] >= 0]
        assert picked.tolist() == chosen.nonzero()[:, 0].tolist()


def test_index_choice_breaks_ties_to_the_lower_entry() -> None:
    inf = float("inf")
    scores = torch.tensor(
        [[1, 2, 2, 2, 0, -inf], [5, 1, 1, 3, 1, -inf], [0.5, -inf, -inf, -inf, -inf, -inf]]
    )
    assert select_topk(scores, 3).tolist() == [[1, 2, 3], [0, 1, 3], [0, -1, -1]]


def test_triton_backend_v4_tokens_and_logprobs_equal_torch_backend(
    smollm2_tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny V4 (sliding, CSA, HCA and CSA layers) prefilling and decoding two prompts side
    by side, its attention's decode rows and its sliding and HCA layers' prefill rows through
    the kernels (every cache starting as NaN: no slot is read before it is written), gives the
    torch backend's tokens and top-5 log-probabilities, in KV cache groups and in one group
    (the MTP drafter's layout; its CSA prefill in torch passes of one block).
    Only the attention's dispatch takes CPU tensors (the other layers' kernels would take most
    of a minute in the interpreter); the CPU keeps torch otherwise."""
    _, path = tiny_deepseek_v4(smollm2_tokenizer, tmp_path / "v4")
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 40000, (n,), generator=generator).tolist() for n in (13, 30)]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=5)
    assert not use_kernels(torch.zeros(1))
    calls = []
    monkeypatch.setattr(v4_attention, "use_kernels", lambda x: calls.append(x) or True)
    runs = {}
    for backend, hybrid in (("torch", True), ("triton", True), ("triton", False)):
        if not hybrid:
            monkeypatch.setattr(v4_decode, "SCORE_BYTES", 1)
        llm = LLM(
            model=path,
            attention_backend=backend,
            max_model_len=48,
            block_size=4,
            hybrid_kv_cache=hybrid,
        )
        for cache in llm.engine.runner.kv_caches:
            cache.fill_(float("nan") if backend == "triton" else 0.0)
        attention = llm.engine.runner.model.v4_attention()
        assert all(a.kernel == (backend == "triton") for a in attention)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        runs[backend, hybrid] = [
            [(t, e.logprob) for step in o.outputs[0].logprobs or [] for t, e in step.items()]
            for o in outputs
        ]
    expected = runs["torch", True]
    for got in (runs["triton", True], runs["triton", False]):
        assert [[t for t, _ in seq] for seq in got] == [[t for t, _ in seq] for seq in expected]
        values = [p for seq in got for _, p in seq]
        # float32 over different reduction orders: seen 1.05e-5 apart on the shared 2-core VM
        assert values == pytest.approx([p for seq in expected for _, p in seq], abs=5e-5)
    assert len(calls) == 2 * 3 * 4  # 2 runs x (a prefill, 2 decode steps) x 4 layers


class HostReads(TorchDispatchMode):
    """Records the ops that read a tensor's values on the host: ``.item()``, ``bool()``,
    ``int()`` (all ``_local_scalar_dense``), nonzero and a boolean mask's indexing (whose
    shape depends on the values); ``.tolist()`` bypasses the dispatcher and is patched."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        masked = name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
        )
        if masked or name in ("_local_scalar_dense", "nonzero", "masked_select", "unique"):
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def _recorded_decodes(
    monkeypatch: pytest.MonkeyPatch, prompts: list[list[int]], overlap: bool
) -> tuple[list[list[int]], list[list[int]], list[str]]:
    """The tiny V4's greedy tokens on the "triton" backend in its KV cache groups (overlapped:
    through the CUDA graphs' padded inputs, run eagerly), its decode steps' context lengths
    and what their forward read on the host."""
    llm = LLM(
        model="shape:tiny-deepseek-v4",
        attention_backend="triton",
        max_model_len=48,
        block_size=4,
        overlap_scheduling=overlap,
    )
    runner = llm.engine.runner
    assert runner.model.graph_safe and (runner.overlapped is not None) == overlap
    if runner.overlapped is not None:  # keys (window 8), CSA and HCA state rows (reach 8)
        assert [w.width for w in runner.overlapped.windows] == [3, 3, 3]
    forward, steps, recorder = runner.model.forward, [], HostReads()
    tolist = torch.Tensor.tolist

    def recorded_tolist(self: torch.Tensor) -> Any:
        recorder.reads.append("tolist")
        return tolist(self)

    def decode_forward(ids: torch.Tensor, positions: torch.Tensor, meta: Any, *rest: Any) -> Any:
        if meta.prefills:
            return forward(ids, positions, meta, *rest)
        steps.append(meta.decode_context_lens.tolist())
        with monkeypatch.context() as patch, recorder:
            patch.setattr(torch.Tensor, "tolist", recorded_tolist)
            return forward(ids, positions, meta, *rest)

    monkeypatch.setattr(runner.model, "forward", decode_forward)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], steps, recorder.reads


def test_v4_decode_steps_on_the_kernels_read_nothing_on_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every layer on its kernels (the interpreter), three rows decoding through contexts
    that close CSA and HCA windows (16, 32, 8) and that close none, in blocks of 4: the
    model's decode-only forward calls no ``.item()`` / ``.tolist()`` / nonzero / mask
    indexing, so the model says it is graph safe; and overlapped, its decode steps run from
    the CUDA graphs' inputs (a bucket of 4 rows, the last a scratch row in every group; the
    window groups' tables 3 blocks wide), with the same tokens."""
    monkeypatch.setattr(dispatch, "_on_cpu", True)
    prompts = [list(range(3, 18)), list(range(50, 81)), list(range(90, 97))]
    eager, steps, reads = _recorded_decodes(monkeypatch, prompts, False)
    assert (steps, reads) == ([[16, 32, 8], [17, 33, 9]], [])
    padded, steps, reads = _recorded_decodes(monkeypatch, prompts, True)
    # the overlapped scheduler runs one more step, whose tokens it drops
    assert (steps, reads) == ([[16, 32, 8, 1], [17, 33, 9, 1], [18, 34, 10, 1]], [])
    assert padded == eager


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_v4_prefill_attention_reads_nothing_on_the_host(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two prompts prefilled side by side (their chunks closing CSA and HCA windows, in blocks
    of 4), then the first again (a prefix hit, replayed whole: the windows of its cached
    entries pool into the scratch block): no attention layer's prefill calls ``.item()`` /
    ``.tolist()`` / nonzero / mask indexing, on the blocked torch path and with every layer
    on its kernels (HCA and sliding through the decode kernel, the interpreter)."""
    if backend == "triton":
        monkeypatch.setattr(dispatch, "_on_cpu", True)
    llm = LLM(
        model="shape:tiny-deepseek-v4", attention_backend=backend, max_model_len=48, block_size=4
    )
    forward, recorder, prefills = v4_attention.V4Attention.forward, HostReads(), []
    tolist = torch.Tensor.tolist

    def recorded_tolist(self: torch.Tensor) -> Any:
        recorder.reads.append("tolist")
        return tolist(self)

    def prefill_forward(self: Any, x: torch.Tensor, positions: torch.Tensor, meta: Any) -> Any:
        if meta.num_decode_tokens:
            return forward(self, x, positions, meta)
        prefills.append(x.shape[0])
        with monkeypatch.context() as patch, recorder:
            patch.setattr(torch.Tensor, "tolist", recorded_tolist)
            return forward(self, x, positions, meta)

    monkeypatch.setattr(v4_attention.V4Attention, "forward", prefill_forward)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    prompts = [list(range(3, 40)), list(range(50, 63))]
    llm.generate(prompts, params, use_tqdm=False)
    llm.generate(prompts[:1], params, use_tqdm=False)
    assert (prefills, recorder.reads) == ([50] * 4 + [37] * 4, [])  # rows a layer's prefill


_SHARED_MEMORY = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from splitserve.kernels.v4_decode import NUM_STAGES, _v4_decode_kernel, default_tiles

ints = {"key_tables_ptr", "key_lens_ptr", "entry_tables_ptr", "lens_ptr", "index_ptr"}
floats = {"sinks_ptr", "part_out_ptr", "part_lse_ptr"}

def kind(name):
    if name.isupper():
        return "constexpr"
    if name.endswith("_ptr"):
        return "*i32" if name in ints else "*fp32" if name in floats else "*bf16"
    return "fp32" if name == "scale_log2" else "i32"

names = _v4_decode_kernel.arg_names
signature = {name: kind(name) for name in names}
# caches whose strides are 16-byte multiples (Triton then pipelines the loads), and not
aligned = {
    (i,): [["tt.divisibility", 16]]
    for i, name in enumerate(names) if not name.isupper() and name != "scale_log2"
}
block_n, block_h, num_warps = default_tiles(64, 512)
for rate, piece, selected in ((4, 160, True), (128, 4, False)):  # CSA, HCA
    for attrs in ({}, aligned):
        constants = dict(
            DIM=512, PAD_D=512, BLOCK_H=block_h, KEY_BLOCK=16, ENTRY_BLOCK=16, RATE=rate,
            PIECE=piece, SELECTED=selected, SPLIT=256, BLOCK_N=block_n, NUM_SPLITS=3,
            PRECISION="tf32", PDL=True,
        )
        source = ASTSource(
            fn=_v4_decode_kernel, signature=signature, constexprs=constants, attrs=attrs
        )
        target = GPUTarget("cuda", 90, 32)
        options = {"num_warps": num_warps, "num_stages": NUM_STAGES}
        kernel = triton.compile(source, target=target, options=options)
        print(kernel.metadata.shared)
"""


def test_v4_decode_kernel_default_tiles_fit_hoppers_shared_memory() -> None:
    """V4-Flash's compressed layers (64 heads of 512, CSA entries of 4 tokens with 128 index
    values, HCA entries of 128) at the default tiles, compiled for sm_90a by Triton on the CPU
    (outside the interpreter, in a process of its own): the program's shared memory within
    the H100's and H200's 232,448 bytes, over caches of any strides and of 16-byte multiples
    (which Triton pipelines). (64 keys a tile asked for 327,680 and failed to launch on the
    H200, CSA over aligned caches 262,656 at 3 stages; the interpreter cannot see this.)"""
    stdout = compile_outside_interpreter(_SHARED_MEMORY)
    shared = [int(n) for n in stdout.split()]
    assert len(shared) == 4 and all(0 < n <= 232_448 for n in shared), shared

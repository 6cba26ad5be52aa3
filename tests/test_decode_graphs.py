"""The padded fixed-shape decode path of CUDA graphs, run eagerly on CPU, changes no token."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.cuda_graphs import DecodeGraphs, WindowGroup, bucket_sizes
from splitserve.engine.kv_groups import StepRows, window_metadata
from splitserve.engine.spec.config import SpeculativeConfig

PROMPTS = ["Once upon a time", "The recipe needs", "Rust or Go? " * 5, "1 2 3", "Dear Sir,"]


def test_bucket_sizes_cover_every_batch_up_to_the_maximum() -> None:
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]


@pytest.mark.slow
def test_padded_decode_path_gives_the_same_tokens(
    make_llm: Callable[..., LLM], smollm2_llm: LLM
) -> None:
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    expected = smollm2_llm.generate(PROMPTS, params, use_tqdm=False)
    llm = make_llm(max_model_len=256, num_kv_blocks=64)
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner, 8, capture=False)
    calls = []
    original = runner.graphs.run
    runner.graphs.run = lambda batch: calls.append(len(batch.requests)) or original(batch)  # type: ignore[method-assign]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert calls and max(calls) == 5
    assert llm.engine.stats().num_free_blocks == 64


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 0, 1]])
def test_fill_packs_the_padded_inputs_and_takes_pending_tokens_from_the_step_in_flight(
    order: list[int],
) -> None:
    """One copy fills the bucket's inputs; tokens the host does not know yet come from the
    step in flight, whether its rows are in the same order (one copy) or not (a gather)."""
    runner = SimpleNamespace(
        device=torch.device("cpu"), max_blocks_per_seq=3, block_size=16, scratch_block=9
    )
    graphs = DecodeGraphs(runner, 4, capture=False)  # type: ignore[arg-type]
    known = SimpleNamespace(num_computed_tokens=20, num_pending=0, block_table=[4, 5],
                            all_token_ids=list(range(100, 121)), draft_token_ids=[])  # fmt: skip
    pending = [
        SimpleNamespace(
            num_computed_tokens=p,
            num_pending=1,
            block_table=table,
            all_token_ids=[],
            draft_token_ids=[],
        )
        for p, table in ((3, [1]), (33, [2, 3, 6]))
    ]
    requests = [pending[0], known, pending[1]]
    in_flight = [requests[i] for i in order]
    prev = SimpleNamespace(
        row_of=lambda: {id(r): row for row, r in enumerate(in_flight)},
        tokens=torch.tensor([1000 + row for row in range(3)]),
    )
    batch = SimpleNamespace(requests=requests)
    graphs._fill(batch, 4, prev)  # type: ignore[arg-type]
    inputs = graphs.inputs[4]
    row_in_flight = {id(r): row for row, r in enumerate(in_flight)}
    assert inputs.input_ids.tolist() == [
        1000 + row_in_flight[id(pending[0])],
        120,
        1000 + row_in_flight[id(pending[1])],
        0,
    ]
    assert inputs.positions.tolist() == [3, 20, 33, 0]
    assert inputs.slots.tolist() == [1 * 16 + 3, 5 * 16 + 4, 6 * 16 + 1, 9 * 16]
    assert inputs.lens.tolist() == [4, 21, 34, 1]
    assert inputs.tables.tolist() == [[1, 9, 9], [4, 5, 9], [2, 3, 6], [9, 9, 9]]


def test_fill_in_the_steady_state_copies_the_tokens_in_flight() -> None:
    runner = SimpleNamespace(
        device=torch.device("cpu"), max_blocks_per_seq=2, block_size=16, scratch_block=7
    )
    graphs = DecodeGraphs(runner, 2, capture=False)  # type: ignore[arg-type]
    requests = [
        SimpleNamespace(
            num_computed_tokens=p,
            num_pending=1,
            block_table=[p],
            all_token_ids=[],
            draft_token_ids=[],
        )
        for p in (2, 5)
    ]
    prev = SimpleNamespace(
        row_of=lambda: {id(r): row for row, r in enumerate(requests)},
        tokens=torch.tensor([41, 42]),
    )
    graphs._fill(SimpleNamespace(requests=requests), 2, prev)  # type: ignore[arg-type]
    assert graphs.inputs[2].input_ids.tolist() == [41, 42]
    assert graphs.inputs[2].slots.tolist() == [2 * 16 + 2, 5 * 16 + 5]


def test_fill_lays_a_verify_step_out_as_a_decode_row_per_draft() -> None:
    """A request with drafts fills 1 + len(drafts) rows: its last token, then each draft at
    the next position, slot and context length, all with its block table."""
    runner = SimpleNamespace(
        device=torch.device("cpu"), max_blocks_per_seq=2, block_size=4, scratch_block=7
    )
    graphs = DecodeGraphs(runner, 2, capture=False, verify_rows=8)  # type: ignore[arg-type]
    plain = SimpleNamespace(num_computed_tokens=1, num_tokens=2, num_pending=0, block_table=[5],
                            all_token_ids=[10, 11], draft_token_ids=[])  # fmt: skip
    drafted = SimpleNamespace(num_computed_tokens=2, num_tokens=3, num_pending=0,
                              block_table=[3, 6], all_token_ids=[20, 21, 22],
                              draft_token_ids=[23, 24])  # fmt: skip
    batch = SimpleNamespace(requests=[plain, drafted], num_new_tokens=[1, 3])
    assert graphs.fits(batch)  # type: ignore[arg-type]
    graphs._fill(batch, 4, None)  # type: ignore[arg-type]
    inputs = graphs.inputs[4]
    assert inputs.input_ids.tolist() == [11, 22, 23, 24]
    assert inputs.positions.tolist() == [1, 2, 3, 4]
    assert inputs.slots.tolist() == [5 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 6 * 4 + 0]
    assert inputs.lens.tolist() == [2, 3, 4, 5]
    assert inputs.tables.tolist() == [[5, 7], [3, 6], [3, 6], [3, 6]]
    drafted.draft_token_ids = [23, 24, 25, 26, 27, 28, 29]  # 1 + 8 rows: more than captured
    assert not graphs.fits(SimpleNamespace(requests=[plain, drafted], num_new_tokens=[1, 8]))  # type: ignore[arg-type]


def test_fill_gives_each_window_group_the_rows_of_its_window_metadata() -> None:
    """A window of 8 in blocks of 4 (tables 3 wide, scratch block 11): rows at contexts 10,
    14 (its window from block 1) and 6 (``window_from`` 4) as ``window_metadata`` makes them,
    the padded row on the scratch block."""
    runner = SimpleNamespace(
        device=torch.device("cpu"), max_blocks_per_seq=4, block_size=4, scratch_block=9
    )
    windows = [WindowGroup.of(8, 4, 11)]
    graphs = DecodeGraphs(runner, 4, capture=False, windows=windows)  # type: ignore[arg-type]
    requests = [
        SimpleNamespace(
            num_computed_tokens=p,
            num_pending=0,
            block_table=[1, 2, 3, 4],
            all_token_ids=list(range(p + 1)),
            draft_token_ids=[],
            window_tables=[table],
            window_from=start,
        )
        for p, table, start in ((9, [20, 21, 22], 0), (13, [11, 30, 31, 32], 0), (5, [11, 41], 4))
    ]
    graphs._fill(SimpleNamespace(requests=requests), 4, None)  # type: ignore[arg-type]
    got = graphs.inputs[4].windows[0]
    assert got.slots.tolist() == [22 * 4 + 1, 32 * 4 + 1, 41 * 4 + 1, 11 * 4]
    assert got.lens.tolist() == [10, 10, 2, 1]
    assert got.tables.tolist() == [[20, 21, 22], [30, 31, 32], [41, 11, 11], [11, 11, 11]]
    steps = [StepRows(r, r.num_computed_tokens, r.num_computed_tokens + 1, i, True)  # type: ignore[arg-type]
             for i, r in enumerate(requests)]  # fmt: skip
    meta = window_metadata(steps, 1, 8, 4, lambda values: torch.tensor(values), False)
    assert meta.slot_mapping.tolist() == got.slots.tolist()[:3]
    assert meta.decode_context_lens.tolist() == got.lens.tolist()[:3]
    assert meta.decode_block_tables.tolist() == [[20, 21, 22], [30, 31, 32], [41, 0, 0]]


@pytest.mark.slow
def test_verify_steps_through_the_padded_decode_path_give_the_same_tokens(
    make_llm: Callable[..., LLM], smollm2_llm: LLM
) -> None:
    """Speculative decoding whose verify steps run as padded decode rows (the CUDA-graph
    path, eager on CPU) keeps the greedy tokens of plain decoding."""
    prompts = [p + " " + p for p in PROMPTS]  # repeats: the n-gram drafter finds drafts
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = smollm2_llm.generate(prompts, params, use_tqdm=False)
    spec = SpeculativeConfig("ngram", 3, None, dynamic=False, prompt_lookup_min=1)
    llm = make_llm(max_model_len=256, num_kv_blocks=64, speculative=spec)
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner, 8, capture=False, verify_rows=32)
    verify_rows = []
    original = runner.graphs.run

    def run(batch):  # type: ignore[no-untyped-def]
        verify_rows.append(sum(batch.num_new_tokens) - len(batch.requests))
        return original(batch)

    runner.graphs.run = run  # type: ignore[method-assign]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert max(verify_rows) > 0  # some steps verified drafts on this path
    assert llm.engine.spec is not None and llm.engine.spec.counters.num_accepted_tokens > 0
    assert llm.engine.stats().num_free_blocks == 64

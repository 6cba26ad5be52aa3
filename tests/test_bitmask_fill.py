"""A batch's bitmask filled on several threads is bit for bit the serial fill, and masks kept
from step to step mask each step as a fresh bitmask would: rows without a grammar untouched
whatever an earlier step left in their buffer row, the buffer grown with the batch."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from benchmarks.structured.decode import SCHEMA, synthetic_vocabulary
from splitserve.engine.sampling_params import StructuredOutputsParams
from splitserve.engine.structured.grammar import GrammarCompiler
from splitserve.engine.structured.matcher import RING, BatchMasks, RequestGrammar

VOCAB = 128_256
TEXT = b'[{"id": 12, "name": "ada", "active": true}, {"id": 7, "name": "bo", "active": false}'
"""Output under SCHEMA; the synthetic vocabulary's tokens 0-255 are its single bytes."""
CUTS = [0, 1, 8, 9, 17, 21, 35, 46]
"""How far each of 8 requests has got: the start, the array, before and inside an integer,
inside a key, a string just opened, after a key, the second object: 8 different masks."""


@pytest.fixture(scope="module")
def compiled() -> xgr.CompiledGrammar:
    compiler = GrammarCompiler.from_vocabulary(synthetic_vocabulary(VOCAB), [VOCAB - 1])
    return compiler.compile(StructuredOutputsParams(json=SCHEMA))


def at(compiled: xgr.CompiledGrammar, cut: int) -> RequestGrammar:
    grammar = RequestGrammar(compiled)
    for byte in TEXT[:cut]:
        assert grammar.accept(byte)
    return grammar


def reference(logits: torch.Tensor, grammars: list[RequestGrammar | None]) -> torch.Tensor:
    """What apply_masks did before buffers were kept: a fresh bitmask, one row after another."""
    expected = logits.clone()
    bitmask = xgr.allocate_token_bitmask(len(grammars), VOCAB)
    rows = [row for row, grammar in enumerate(grammars) if grammar is not None]
    for row in rows:
        grammar = grammars[row]
        assert grammar is not None
        grammar.matcher.fill_next_token_bitmask(bitmask, row)
    xgr.apply_token_bitmask_inplace(expected, bitmask, indices=rows)
    return expected


def test_the_threaded_fill_sets_exactly_the_bits_of_the_serial_fill(
    compiled: xgr.CompiledGrammar,
) -> None:
    matchers = [at(compiled, cut).matcher for cut in CUTS]
    rows = [0, 2, 3, 5, 8, 9, 11, 15]  # scattered in a batch of 16
    serial, threaded = (xgr.allocate_token_bitmask(16, VOCAB) for _ in range(2))
    BatchMasks(threads=1).fill(serial, matchers, rows)
    BatchMasks(threads=2).fill(threaded, matchers, rows)
    assert torch.equal(threaded, serial)
    assert len({tuple(serial[row].tolist()) for row in rows}) == len(CUTS)  # 8 states
    untouched = [row for row in range(16) if row not in rows]
    assert bool((serial[untouched] == -1).all())


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
        ),
    ],
)
def test_kept_buffers_mask_every_step_as_a_fresh_bitmask_does(
    compiled: xgr.CompiledGrammar, device: str
) -> None:
    grammars = [at(compiled, cut) for cut in CUTS]
    masks = BatchMasks(threads=2)
    # Batches that grow, shrink and move their free rows; more steps than the ring has buffers.
    batches: list[list[RequestGrammar | None]] = [
        [grammars[0], None, grammars[1]],
        [*grammars[:4], None, *grammars[4:]],
        [None, grammars[4], None],
        [None, *grammars, None],
        [*grammars[:5]],
    ]
    assert len(batches) > RING + 1
    generator = torch.Generator().manual_seed(0)
    for step, batch in enumerate(batches):
        logits = torch.randn(len(batch), VOCAB, generator=generator)
        expected = reference(logits, batch)
        on_device = logits.to(device)
        masks.apply(on_device, batch)
        assert torch.equal(on_device.cpu(), expected), f"step {step}"
        free = [row for row, grammar in enumerate(batch) if grammar is None]
        assert torch.equal(on_device.cpu()[free], logits[free])
        for grammar, cut in zip(grammars, CUTS):
            assert grammar.accept(TEXT[cut + step])

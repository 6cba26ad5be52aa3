"""The whole decoder stack in one native call (engine/layers/native_decode.py) against the
modules making the same native calls one by one."""

from __future__ import annotations

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.layers.attention import AttentionMetadata, PrefillSegment
from splitserve.kernels.native.blocks import native_available, set_native_isa

pytestmark = [
    pytest.mark.skipif(not native_available(), reason="no C compiler here"),
    pytest.mark.slow,
]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three red fruits:"]


def _run(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    return [
        (o.token_ids, [e.logprob for step in o.logprobs or [] for e in step.values()]) for o in outs
    ]


@pytest.mark.parametrize("isa", [None, "avx2"])
def test_native_stack_equals_the_module_path_exactly(smollm2_llm: LLM, isa: str | None) -> None:
    # With the products capped at AVX2 (on an AVX-512 CPU), the stack must take the cap too.
    model = smollm2_llm.engine.runner.model
    fast = model.native_decode
    assert fast is not None
    set_native_isa(isa)
    try:
        with_stack = _run(smollm2_llm)
        model.native_decode = None
        with_modules = _run(smollm2_llm)
    finally:
        model.native_decode = fast
        set_native_isa(None)
    assert with_stack == with_modules


def test_native_stack_takes_decode_only_steps_below_the_gemm_switch(smollm2_llm: LLM) -> None:
    fast = smollm2_llm.engine.runner.model.native_decode
    assert fast is not None
    tables, lens = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long)
    decode = AttentionMetadata(torch.zeros(2, dtype=torch.long), 2, tables, lens, [])
    x = torch.zeros(2, fast.hidden)
    assert fast.takes(x, decode)
    mixed = AttentionMetadata(
        torch.zeros(3, dtype=torch.long), 2, tables, lens,
        [PrefillSegment(2, 1, 1, torch.zeros(1, dtype=torch.long))],
    )  # fmt: skip
    assert not fast.takes(torch.zeros(3, fast.hidden), mixed)
    rows = fast.max_rows
    if rows < 1 << 30:
        wide = AttentionMetadata(torch.zeros(rows, dtype=torch.long), rows, tables, lens, [])
        assert not fast.takes(torch.zeros(rows, fast.hidden), wide)

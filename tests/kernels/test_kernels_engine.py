"""The engine on the "triton" attention backend gives the torch backend's greedy tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from splitserve import SamplingParams
from tests.support.tiny_models import tiny_llm, tiny_model


def test_triton_backend_greedy_tokens_equal_torch_backend(
    smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    _, path = tiny_model(
        smollm2_tokenizer, tmp_path / "llama", hidden_size=96, intermediate_size=160,
        num_attention_heads=6, max_position_embeddings=256,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 40000, (n,), generator=generator).tolist() for n in (5, 19, 40)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    tokens = {}
    # The triton kernels must never read a slot that was not written: its cache starts as NaN.
    # The torch backend's masked softmax lets NaN in unwritten slots through (0 * NaN), so its
    # cache starts as zeros.
    for backend, fill in (("torch", 0.0), ("triton", float("nan"))):
        # A 24-token chunk budget splits the longest prompt over two steps (a cached prefix).
        llm = tiny_llm(
            path,
            smollm2_tokenizer,
            attention_backend=backend,
            max_model_len=128,
            block_size=16,
            num_kv_blocks=32,
            max_num_batched_tokens=24,
        )
        llm.engine.runner.kv_cache.fill_(fill)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens[backend] = [o.outputs[0].token_ids for o in outputs]
    assert tokens["triton"] == tokens["torch"]
    assert all(len(t) == 12 for t in tokens["torch"])

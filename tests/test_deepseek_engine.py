"""DeepSeek-V2/V3 (MLA, DeepSeekMoE) against transformers on tiny random checkpoints: greedy
token ids equal offline, with the KV cache holding one latent per token and layer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from splitserve import LLM, SamplingParams
from tests.support.reference import assert_greedy_equal, hf_continuation
from tests.support.tiny_models import (
    tiny_deepseek_v2,
    tiny_deepseek_v2_grouped,
    tiny_deepseek_v3,
    tiny_llm,
)

BUILDERS: dict[str, Callable[[Any, Path], tuple[Any, str]]] = {
    "v2-lite": tiny_deepseek_v2,
    "v2-grouped": tiny_deepseek_v2_grouped,
    "v3": tiny_deepseek_v3,
}
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def prompts(lengths: tuple[int, ...] = (5, 17, 40, 90)) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, 40000, (n,), generator=generator).tolist() for n in lengths]


def assert_matches_transformers(model: Any, llm: LLM, batch: list[list[int]]) -> None:
    outputs = llm.generate(batch, GREEDY, use_tqdm=False)
    equal = [
        assert_greedy_equal(model, p, o.outputs[0].token_ids, hf_continuation(model, p, 32))
        for p, o in zip(batch, outputs)
    ]
    assert all(equal), f"sequences wholly equal: {equal}"


@pytest.mark.parametrize("variant", sorted(BUILDERS))
def test_tiny_deepseek_greedy_matches_transformers(
    variant: str, smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    model, path = BUILDERS[variant](smollm2_tokenizer, tmp_path / variant)
    llm = tiny_llm(path, smollm2_tokenizer, max_model_len=512, block_size=8)
    assert_matches_transformers(model, llm, prompts())


def test_deepseek_cache_holds_one_latent_per_token_and_layer(
    smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    _, path = tiny_deepseek_v3(smollm2_tokenizer, tmp_path / "v3")
    llm = tiny_llm(path, smollm2_tokenizer, max_model_len=512, block_size=8, num_kv_blocks=20)
    runner = llm.engine.runner
    # kv_lora_rank 32 + qk_rope_head_dim 16, 3 layers, one part (no separate K and V).
    assert runner.kv_shape(5) == (1, 3, 5, 8, 1, 48)
    assert runner.kv_bytes_per_block() == 3 * 8 * 48 * 4
    assert tuple(runner.kv_cache.shape) == (1, 3, 21, 8, 1, 48)


def test_chunked_prefill_and_mixed_steps_match_transformers(
    smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    """Prompts prefilled in 24-token chunks beside decoding ones: the chunks' attention
    reads the earlier chunks' latents from the cache."""
    model, path = tiny_deepseek_v3(smollm2_tokenizer, tmp_path / "v3")
    llm = tiny_llm(
        path, smollm2_tokenizer, max_model_len=512, block_size=8, max_num_batched_tokens=24
    )
    assert_matches_transformers(model, llm, prompts((3, 60, 9, 75)))


def test_shape_first_layers_keep_the_dense_layers_below_them() -> None:
    from splitserve.engine.shapes import shape_config

    full = shape_config("deepseek-v3")
    four = shape_config("deepseek-v3?layers=4")
    assert (full.num_layers, four.num_layers) == (61, 4)
    assert four.moe is not None and four.moe.dense_layers == (0, 1, 2)
    assert shape_config("deepseek-v3?layers=2").moe.dense_layers == (0, 1)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="layers=N"):
        shape_config("deepseek-v3?layers=62")


def test_random_weight_deepseek_shape_generates(tmp_path: Path) -> None:
    llm = LLM(model="shape:tiny-deepseek-v3", block_size=8, num_kv_blocks=32)
    out = llm.generate([[5, 17, 300, 42]], GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 32


def test_absorbed_decode_equals_attention_over_expanded_keys_and_values() -> None:
    """mla_decode (the absorbed form over the paged latent cache) against plain attention of
    each head over keys and values expanded through kv_b_proj, ragged contexts."""
    from splitserve.engine.layers.attention import AttentionMetadata, TorchAttention
    from splitserve.engine.layers.mla import MLAAttention
    from splitserve.engine.shapes import shape_config

    torch.manual_seed(0)
    cfg = shape_config("tiny-deepseek-v3")
    attn = MLAAttention(cfg, TorchAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))
    heads, mla = attn.num_heads, attn.mla
    block, lens = 8, [3, 17, 30]
    attn.latent_cache = torch.randn(12, block, 1, mla.latent_dim)
    tables = torch.tensor([[4, 0, 0, 0], [1, 7, 2, 0], [9, 3, 11, 5]])
    meta = AttentionMetadata(torch.zeros(3, dtype=torch.long), 3, tables, torch.tensor(lens), [])
    q_nope = torch.randn(3, heads, mla.qk_nope_head_dim)
    q_rope = torch.randn(3, heads, mla.qk_rope_head_dim)
    out = attn.decode(q_nope, q_rope, meta)
    for row, length in enumerate(lens):
        slots = [tables[row, p // block] * block + p % block for p in range(length)]
        latent = attn.latent_cache.view(-1, mla.latent_dim)[torch.tensor(slots)]
        kv = attn.kv_b_proj(latent[:, : mla.kv_lora_rank]).view(length, heads, -1)
        k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        scores = torch.einsum("hd,lhd->hl", q_nope[row], k_nope)
        scores += torch.einsum("hd,ld->hl", q_rope[row], latent[:, mla.kv_lora_rank :])
        expected = torch.einsum("hl,lhd->hd", (scores * attn.scale).softmax(-1), v)
        torch.testing.assert_close(out[row], expected, rtol=1e-5, atol=1e-5)


def test_deepseek_shapes_have_the_published_sizes_in_the_roofline() -> None:
    """Every expert counted, the layers' weights plus embedding and head are DeepSeek-V3's
    671B and V2-Lite's 15.7B; a token's latent cache is 576 values a layer."""
    from splitserve.bench.roofline import kv_bytes_per_token, matmul_params
    from splitserve.engine.shapes import shape_config

    for name, total, kv_bytes in (
        ("deepseek-v3", 671_025_397_760, 61 * 576 * 2),
        ("deepseek-v2-lite", 15_706_357_760, 27 * 576 * 2),
    ):
        cfg = shape_config(name)
        assert cfg.moe is not None
        everything = matmul_params(cfg, cfg.moe.num_experts) + 2 * cfg.hidden_size * cfg.vocab_size
        assert (everything, kv_bytes_per_token(cfg, 2)) == (total, kv_bytes)

"""Gemma 3's layout on a tiny random checkpoint: greedy tokens equal to transformers with a
sliding window of 8 on prompts many windows long, decoding past the window, prefilled whole
and in chunks; its configs in both of their forms."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from splitserve import SamplingParams
from splitserve.engine.layers.attention_backends import choose_backend
from splitserve.engine.local_attention import LocalAttention
from splitserve.engine.model_config import ModelConfig
from tests.support.reference import assert_greedy_equal
from tests.support.tiny_models import tiny_gemma3, tiny_llm

WINDOW = 8
LENGTHS = (5, 17, 40, 90)
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def tiny(smollm2_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, str]:
    return tiny_gemma3(smollm2_tokenizer, tmp_path_factory.mktemp("gemma3") / "m", WINDOW)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(3, 40000, (n,), generator=generator).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(tiny: tuple[Any, str], prompts: list[list[int]]) -> list[list[int]]:
    return [continuation(tiny[0], prompt) for prompt in prompts]


def continuation(model: Any, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("chunk", [2048, 16], ids=["whole", "chunked"])
def test_gemma3_greedy_matches_transformers_past_the_window(
    tiny: tuple[Any, str],
    prompts: list[list[int]],
    reference: list[list[int]],
    chunk: int,
    smollm2_tokenizer: Any,
) -> None:
    """One batch (prefills beside decodes); chunked: 16-token steps, so later chunks attend
    over cached context longer than the window."""
    hf_model, path = tiny
    llm = tiny_llm(
        path, smollm2_tokenizer, max_model_len=512, block_size=8, max_num_batched_tokens=chunk
    )
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    equal = [
        assert_greedy_equal(hf_model, prompt, output.outputs[0].token_ids, ref)
        for prompt, output, ref in zip(prompts, outputs, reference)
    ]
    assert all(equal), f"sequences wholly equal: {equal}"


def test_the_window_changes_the_tiny_models_output(
    tiny: tuple[Any, str], prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """The check above would hold a model that ignored its window to nothing otherwise."""
    hf_model, _ = tiny
    hf_model.config.sliding_window = 4096
    try:
        assert continuation(hf_model, prompts[-1]) != reference[-1]
    finally:
        hf_model.config.sliding_window = WINDOW


def test_gemma3_configs_in_the_hub_form_and_transformers_5_form_agree() -> None:
    base = {
        "model_type": "gemma3_text", "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 7, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 32, "sliding_window": 8,
        "query_pre_attn_scalar": 48, "rms_norm_eps": 1e-6,
    }  # fmt: skip
    hub = ModelConfig.from_hf(
        base | {"rope_theta": 50000.0, "rope_local_base_freq": 10000.0,
                "rope_scaling": {"rope_type": "linear", "factor": 2.0},
                "sliding_window_pattern": 6}
    )  # fmt: skip
    layer_types = ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
    }
    new = ModelConfig.from_hf(base | {"rope_parameters": rope, "layer_types": layer_types})
    assert hub == new
    assert new.local_attention == LocalAttention(8, (0, 1, 2, 3, 4, 6), 10000.0)
    assert (new.rope_theta, new.rope_scaling) == (50000.0, {"rope_type": "linear", "factor": 2.0})
    assert new.attention_scale == 48**-0.5 and new.qk_norm and new.sliding_window is None


def test_gemma3_attention_softcapping_is_refused() -> None:
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        ModelConfig.from_hf(
            {"model_type": "gemma3_text", "vocab_size": 8, "hidden_size": 8,
             "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
             "attn_logit_softcapping": 50.0}
        )  # fmt: skip


def test_auto_attention_takes_torch_for_sliding_windows_on_cuda() -> None:
    assert choose_backend("auto", "cuda", True, sliding_window=True) == "torch"
    assert choose_backend("auto", "cuda", True, sliding_window=False) == "triton"


def test_the_triton_backend_refuses_a_sliding_window() -> None:
    pytest.importorskip("triton")
    from splitserve.engine.layers.triton_attention import TritonAttention

    with pytest.raises(ValueError, match="sliding window"):
        TritonAttention(4, 1, 32).configured(None, WINDOW)

"""MTP speculative decoding: DeepSeek-V3's multi-token-prediction layer drafts, the target
verifies; greedy output is exactly the plain greedy output (float32), acceptance reported.

The tiny checkpoint's MTP layer (written here: transformers drops MTP weights) is built to
predict like the target's own embedding-to-head path: its decoder block adds nothing (zero
output projections) and eh_proj passes the normed token embedding through, so it drafts
what a target without layers would say next. The target's layers are scaled down, so that
it mostly agrees and sometimes does not: drafts are accepted and rejected."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve import SamplingParams
from splitserve.engine.spec.config import SpeculativeConfig
from tests.support.reference import assert_greedy_equal, hf_continuation
from tests.support.tiny_models import tiny_deepseek_v2, tiny_deepseek_v3, tiny_llm

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
OUTPUTS = ("o_proj", "down_proj")


def with_mtp_layer(model: Any, path: str) -> None:
    """Adds layer 3 (the MTP layer past the 3 decoder layers) to the checkpoint at path."""
    weights = load_file(f"{path}/model.safetensors")
    hidden = model.config.hidden_size
    mtp = {
        name.replace("model.layers.2.", "model.layers.3."): (
            torch.zeros_like(tensor) if name.split(".")[-2] in OUTPUTS else tensor
        )
        for name, tensor in weights.items()
        if name.startswith("model.layers.2.")
    }
    mtp |= {
        "model.layers.3.enorm.weight": torch.ones(hidden),
        "model.layers.3.hnorm.weight": torch.ones(hidden),
        "model.layers.3.eh_proj.weight": torch.cat(
            [torch.eye(hidden), torch.zeros(hidden, hidden)], 1
        ),
        "model.layers.3.shared_head.norm.weight": weights["model.norm.weight"],
        "model.layers.3.shared_head.head.weight": weights["lm_head.weight"],
        "model.layers.3.embed_tokens.weight": weights["model.embed_tokens.weight"],
    }
    save_file(mtp, f"{path}/model-mtp.safetensors")
    config_file = Path(path) / "config.json"
    config = json.loads(config_file.read_text())
    config["num_nextn_predict_layers"] = 1
    config_file.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def checkpoint(smollm2_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, str]:
    folder = tmp_path_factory.mktemp("mtp") / "v3"
    model, path = tiny_deepseek_v3(smollm2_tokenizer, folder)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("model.layers.") and name.split(".")[-2] in OUTPUTS:
                param.mul_(0.003)
        for name, param in model.named_parameters():
            if "experts.down_proj" in name:  # transformers 5 stacks the experts
                param.mul_(0.003)
    model.save_pretrained(path, safe_serialization=True)
    with_mtp_layer(model, path)
    return model, path


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, 40000, (n,), generator=generator).tolist() for n in (4, 19, 33)]


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_drafts_give_exactly_the_plain_greedy_tokens(
    checkpoint: tuple[Any, str], k: int, smollm2_tokenizer: Any
) -> None:
    model, path = checkpoint
    plain = tiny_llm(path, smollm2_tokenizer, max_model_len=256, block_size=8)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts(), GREEDY, use_tqdm=False)]
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=k, dynamic=False)
    llm = tiny_llm(path, smollm2_tokenizer, max_model_len=256, block_size=8, speculative=spec)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]
    assert got == expected
    prompt = prompts()[0]
    assert assert_greedy_equal(model, prompt, expected[0], hf_continuation(model, prompt, 24))
    counters = llm.engine.spec.counters  # type: ignore[union-attr]
    assert counters.num_draft_tokens > 0
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    assert sum(counters.accepted_per_pos) == counters.num_accepted_tokens
    assert counters.accepted_per_pos[-1] > 0  # a chained draft (from the MTP's own hidden)
    assert counters.mean_acceptance_length > 1.0


def test_mtp_needs_a_checkpoint_with_an_mtp_layer(smollm2_tokenizer: Any, tmp_path: Path) -> None:
    _, path = tiny_deepseek_v2(smollm2_tokenizer, tmp_path / "v2")
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="needs a model with an MTP layer"):
        tiny_llm(path, smollm2_tokenizer, max_model_len=256, block_size=8, speculative=spec)

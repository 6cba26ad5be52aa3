"""MTP speculative decoding on DeepSeek-V4: the checkpoint's MTP block (``mtp.0.*``) drafts,
the target verifies; greedy output is exactly the plain greedy output (float32).

transformers' V4 writes no MTP tensors (its config says ``num_nextn_predict_layers: 1``), so
the test writes them in DeepSeek's release names: the block is a copy of the CSA layer 1
(compressor, indexer, hyper-connections, top-k MoE; config.json lists a fifth layer kind, the
block's), the embedding goes through (``e_proj`` the identity) and the target's streams add a
little (``h_proj`` small). The output projections of every layer, the block's too, are scaled
down, so that target and block both predict nearly what the embedding-to-head path says:
drafts are mostly accepted, sometimes not."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve import LLM, SamplingParams
from splitserve.engine.spec.config import SpeculativeConfig
from tests.support.tiny_models import tiny_deepseek_v4

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
OUTPUTS = ("wo_b", "w2")
SCALE = 0.003


def with_mtp_block(path: str) -> None:
    """Scales the layers' outputs down and writes ``mtp.0.*`` beside the checkpoint."""
    file = f"{path}/model.safetensors"
    weights = load_file(file)
    for name, tensor in weights.items():
        if name.startswith("model.layers.") and name.split(".")[-2] in OUTPUTS:
            tensor.mul_(SCALE)
    save_file(weights, file)
    hidden = weights["model.norm.weight"].shape[0]
    mtp = {
        name.replace("model.layers.1.", "mtp.0."): tensor.clone()
        for name, tensor in weights.items()
        if name.startswith("model.layers.1.")
    }
    mtp |= {
        f"mtp.0.hc_head_{part}": weights[f"model.hc_head.hc_{part}"].clone()
        for part in ("fn", "base", "scale")
    }
    mtp |= {
        "mtp.0.enorm.weight": torch.ones(hidden),
        "mtp.0.hnorm.weight": torch.ones(hidden),
        "mtp.0.e_proj.weight": torch.eye(hidden),
        "mtp.0.h_proj.weight": 0.02 * torch.randn(hidden, hidden),
        "mtp.0.norm.weight": weights["model.norm.weight"].clone(),
    }
    save_file(mtp, f"{path}/model-mtp.safetensors")
    config_file = Path(path) / "config.json"
    config = json.loads(config_file.read_text())
    config["layer_types"].append("compressed_sparse_attention")  # the MTP block's
    config_file.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def checkpoint(smollm2_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    _, path = tiny_deepseek_v4(smollm2_tokenizer, tmp_path_factory.mktemp("v4mtp") / "v4")
    torch.manual_seed(0)
    with_mtp_block(path)
    return path


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, 40000, (n,), generator=generator).tolist() for n in (4, 19, 33)]


@pytest.fixture(scope="module")
def plain(checkpoint: str) -> list[list[int]]:
    llm = LLM(model=checkpoint, max_model_len=256, block_size=8)
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("k", [1, 2])
def test_mtp_drafts_give_exactly_the_plain_greedy_tokens(
    checkpoint: str, plain: list[list[int]], k: int
) -> None:
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=k, dynamic=False)
    llm = LLM(model=checkpoint, max_model_len=256, block_size=8, speculative=spec)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]
    assert got == plain
    mtp = llm.engine.spec.drafter.mtp
    assert mtp.layers[0].self_attn.kind == "csa"  # the fifth layer kind
    assert mtp.layers[0].mlp.tid2eid is None  # past the hashed layers: routed by scores
    counters = llm.engine.spec.counters
    assert counters.num_draft_tokens > 0
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    assert sum(counters.accepted_per_pos) == counters.num_accepted_tokens
    assert counters.accepted_per_pos[-1] > 0  # with k = 2: a chained draft accepted


def test_mtp_needs_the_checkpoints_mtp_tensors(checkpoint: str, tmp_path: Path) -> None:
    """As transformers writes V4: ``num_nextn_predict_layers: 1`` but no ``mtp.*``."""
    path = shutil.copytree(checkpoint, tmp_path / "v4", ignore=shutil.ignore_patterns("*mtp*"))
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=1)
    with pytest.raises(ValueError, match=r"the checkpoint has no mtp\.0\.\* tensors"):
        LLM(model=str(path), max_model_len=256, block_size=8, speculative=spec)

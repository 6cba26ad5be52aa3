"""DeepSeek's FP8 block-scaled checkpoints: float8_e4m3fn weights with one float32
``weight_scale_inv`` per 128 x 128 block load as their dequantized bfloat16 values."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from splitserve import SamplingParams
from splitserve.engine.fp8_weights import dequantize_block_fp8
from splitserve.kernels.fp8_quant import BlockFp8, dequantize_blocks
from tests.support.tiny_models import tiny_deepseek_v3, tiny_llm

BLOCK = (128, 128)
FP8_MAX = 448.0


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [R, C] -> (float8_e4m3fn [R, C], scale_inv [ceil(R/128), ceil(C/128)]), each
    block scaled so that its largest magnitude is FP8's largest."""
    rows, cols = weight.shape
    grid = (-(-rows // BLOCK[0]), -(-cols // BLOCK[1]))
    scale = torch.empty(grid)
    quantized = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = (
                slice(i * BLOCK[0], (i + 1) * BLOCK[0]),
                slice(j * BLOCK[1], (j + 1) * BLOCK[1]),
            )
            scale[i, j] = weight[part].abs().max().clamp(min=1e-12) / FP8_MAX
            quantized[part] = (weight[part] / scale[i, j]).to(torch.float8_e4m3fn)
    return quantized, scale


def quantized_projection(name: str, tensor: torch.Tensor) -> bool:
    """What DeepSeek-V3's FP8 release quantizes: the layers' projections (not the norms, the
    router, the embeddings or the head)."""
    return (
        name.startswith("model.layers.")
        and tensor.dim() == 2
        and "layernorm" not in name
        and not name.endswith("mlp.gate.weight")
    )


def test_partial_blocks_take_their_own_scale() -> None:
    weight = torch.randn(300, 200, generator=torch.Generator().manual_seed(0))
    quantized, scale = quantize(weight)
    assert scale.shape == (3, 2)
    out = dequantize_block_fp8(quantized, scale, BLOCK)
    assert out.dtype == torch.bfloat16
    expected = quantized.float()
    expected[:128, 128:] *= scale[0, 1]
    expected[:128, :128] *= scale[0, 0]
    expected[128:256, :128] *= scale[1, 0]
    expected[128:256, 128:] *= scale[1, 1]
    expected[256:, :128] *= scale[2, 0]
    expected[256:, 128:] *= scale[2, 1]
    assert torch.equal(out, expected.to(torch.bfloat16))
    assert (out.float() - weight).norm() / weight.norm() < 0.04


def test_fp8_checkpoint_loads_its_dequantized_weights(
    smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    """The FP8 checkpoint (scales in a shard of their own) loads exactly as a float32
    checkpoint of its dequantized weights, which are within FP8's precision of the
    originals, and generates the same tokens."""
    _, path = tiny_deepseek_v3(smollm2_tokenizer, tmp_path / "v3")
    original = load_file(f"{path}/model.safetensors")
    fp8_dir, dequantized_dir = tmp_path / "fp8", tmp_path / "dequantized"
    for folder in (fp8_dir, dequantized_dir):
        shutil.copytree(path, folder)
        (folder / "model.safetensors").unlink()
    weights, scales, dequantized = {}, {}, {}
    for name, tensor in original.items():
        weights[name] = dequantized[name] = tensor
        if quantized_projection(name, tensor):
            weights[name], scales[f"{name}_scale_inv"] = quantize(tensor)
            dequantized[name] = dequantize_block_fp8(
                weights[name], scales[f"{name}_scale_inv"], BLOCK
            ).float()
            assert (dequantized[name] - tensor).norm() / tensor.norm() < 0.04, name
    assert len(scales) == 3 * 5 + 3 + 2 * (8 * 3 + 3)  # attention, dense MLP, 2 MoE layers
    save_file(weights, str(fp8_dir / "model-00001.safetensors"))
    save_file(scales, str(fp8_dir / "model-00002.safetensors"))
    save_file(dequantized, str(dequantized_dir / "model.safetensors"))
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(BLOCK)}
    (fp8_dir / "config.json").write_text(json.dumps(config))

    fp8 = tiny_llm(str(fp8_dir), smollm2_tokenizer, max_model_len=256, block_size=8)
    reference = tiny_llm(str(dequantized_dir), smollm2_tokenizer, max_model_len=256, block_size=8)
    ours = dict(fp8.engine.runner.model.named_parameters())
    for name, param in reference.engine.runner.model.named_parameters():
        assert torch.equal(ours[name], param), name
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = [[5, 900, 31, 7000, 12]]
    assert (
        fp8.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        == reference.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    )


def test_quantization_fp8_loads_an_fp8_checkpoint_as_it_is(
    smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    """With ``quantization="fp8"`` the checkpoint's e4m3 blocks and scales land in the FP8
    layers unchanged (q_a | kv_a fused, gate | up fused, experts stacked, RoPE rows reordered
    inside their blocks), kv_b_proj (kept in float) is dequantized; and they are the blocks
    that quantizing the dequantized checkpoint at load gives, so both engines generate the
    same tokens. Sizes on 128-row blocks, as DeepSeek-V3's: a fused part must start on one."""
    aligned = dict(
        hidden_size=128, q_lora_rank=128, kv_lora_rank=128, qk_rope_head_dim=64,
        qk_nope_head_dim=64, v_head_dim=64, moe_intermediate_size=128, num_hidden_layers=2,
    )  # fmt: skip
    _, path = tiny_deepseek_v3(smollm2_tokenizer, tmp_path / "v3", **aligned)
    original = load_file(f"{path}/model.safetensors")
    fp8_dir, dequantized_dir = tmp_path / "fp8", tmp_path / "dequantized"
    for folder in (fp8_dir, dequantized_dir):
        shutil.copytree(path, folder)
        (folder / "model.safetensors").unlink()
    weights, dequantized = dict(original), dict(original)
    for name, tensor in original.items():
        if quantized_projection(name, tensor):
            weights[name], weights[f"{name}_scale_inv"] = quantize(tensor)
            fp8 = BlockFp8(weights[name], weights[f"{name}_scale_inv"])
            dequantized[name] = dequantize_blocks(fp8)  # float32: no rounding of its own
            if "kv_b_proj" in name:  # not an FP8 layer: the loader dequantizes it to bfloat16
                dequantized[name] = dequantize_block_fp8(fp8.data, fp8.scale, BLOCK).float()
    save_file(weights, str(fp8_dir / "model.safetensors"))
    save_file(dequantized, str(dequantized_dir / "model.safetensors"))
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(BLOCK)}
    (fp8_dir / "config.json").write_text(json.dumps(config))

    fp8_engine = dict(max_model_len=128, block_size=8, quantization="fp8")
    kept = tiny_llm(str(fp8_dir), smollm2_tokenizer, **fp8_engine)
    requantized = tiny_llm(str(dequantized_dir), smollm2_tokenizer, **fp8_engine)
    ours = dict(kept.engine.runner.model.named_parameters())
    layer = ours["layers.1.mlp.w13"]
    assert layer.dtype == torch.float8_e4m3fn and ours["layers.1.mlp.w13_scale_inv"].shape == (
        8, 2, 1,
    )  # fmt: skip
    gate = weights["model.layers.1.mlp.experts.3.gate_proj.weight"]
    assert torch.equal(layer[3, :128].view(torch.uint8), gate.view(torch.uint8))
    assert torch.equal(
        ours["layers.0.self_attn.in_proj.weight_scale_inv"][:1],
        weights["model.layers.0.self_attn.q_a_proj.weight_scale_inv"],
    )
    assert ours["layers.0.self_attn.kv_b_proj.weight"].dtype == torch.float32
    for name, param in requantized.engine.runner.model.named_parameters():
        if param.dtype == torch.float8_e4m3fn:
            assert torch.equal(ours[name].view(torch.uint8), param.view(torch.uint8)), name
        else:  # a scale: 448 * s / 448 may be one float32 ulp off s
            torch.testing.assert_close(ours[name], param, rtol=1e-6, atol=0)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = [[5, 900, 31, 7000, 12]]
    assert (
        kept.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        == requantized.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    )

"""Device ceilings measured in the run, and the traffic / work a model step must do.

MBU = achieved bytes/s over the measured copy bandwidth; MFU = achieved FLOP/s over the
measured matmul throughput. Both ceilings come from the same process as the result, and where
the device has a reference (``reference_ceilings``) the shares are given against it too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from splitserve.bench import v4_roofline
from splitserve.engine.layers.bf16_linear import Bf16Linear
from splitserve.engine.model_config import ModelConfig


@dataclass(frozen=True)
class Ceilings:
    bandwidth_bytes_per_s: float
    matmul_flops_per_s: float


REFERENCE_CEILINGS = {
    ("H200", torch.bfloat16): Ceilings(4.24e12, 805e12),
}
"""Stable ceilings per (device name part, dtype), measured once on the device machines (H200:
4.24 TB/s copy bandwidth, 805 TFLOP/s bf16 dense matmul). The matmul ceiling measured in a run
swings (727-798 TFLOP/s on one H200 across runs), so a share against it alone moves with the
measurement."""


def reference_ceilings(device_name: str, dtype: torch.dtype) -> Ceilings | None:
    """The stable ceilings of a device (``torch.cuda.get_device_name``) in dtype, if known."""
    for (name, reference_dtype), ceilings in REFERENCE_CEILINGS.items():
        if name in device_name and dtype == reference_dtype:
            return ceilings
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_ceilings(device: torch.device, dtype: torch.dtype) -> Ceilings:
    """Copy bandwidth (read + write bytes) and square-matmul throughput in dtype."""
    gpu = device.type == "cuda"
    numel = (1 << 30 if gpu else 1 << 27) // 4
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = _best_time(lambda: dst.copy_(src), device, 10 if gpu else 5)
    bandwidth = 2 * src.numel() * src.element_size() / seconds
    n = 8192 if gpu else 1024
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = _best_time(lambda: a @ b, device, 10 if gpu else 3)
    if not gpu:  # the engine's own CPU GEMM: torch's matmul is MKL's, slow on AMD CPUs
        seconds = min(seconds, _onednn_seconds(a, b))
    return Ceilings(bandwidth, 2 * n**3 / seconds)


def _onednn_seconds(a: torch.Tensor, b: torch.Tensor) -> float:
    """a @ b through oneDNN on a packed b, as the engine's CPU projections run
    (``engine/layers/cpu_gemm.py``); inf where this torch cannot. The ceilings measured with
    torch's matmul alone read 0.18-0.20 TFLOP/s on the project's AMD EPYC VM, below the
    prefill the engine itself ran (MFU 1.3-1.8)."""
    from splitserve.engine.layers.cpu_gemm import pack_weight, packed_linear

    packed = pack_weight(b.t().contiguous())
    if packed is None:
        return float("inf")
    return _best_time(lambda: packed_linear(a, packed), a.device, 3)


def matmul_params(cfg: ModelConfig, experts: float | None = None) -> int:
    """Weights touched by the transformer layers' matmuls (embeddings excluded). MoE layers
    count their router and ``experts`` experts (default: top_k, what one token multiplies).
    DeepSeek-V4's are ``v4_roofline``'s, with its routers and hyper-connection mixes."""
    if cfg.v4 is not None:
        return round(v4_roofline.v4_weights(cfg, experts).matmul) + v4_roofline.mixes(cfg)
    attention = attention_params(cfg)
    dense = 3 * cfg.hidden_size * cfg.intermediate_size
    if cfg.moe is None:
        return cfg.num_layers * (attention + dense)
    moe = cfg.moe
    routed = moe.top_k if experts is None else experts
    experts_width = routed * moe.intermediate_size + moe.shared_intermediate_size
    sparse = cfg.hidden_size * moe.num_experts + 3 * cfg.hidden_size * experts_width
    num_dense = len(moe.dense_layers)
    return round(
        cfg.num_layers * attention + num_dense * dense + (cfg.num_layers - num_dense) * sparse
    )


def attention_params(cfg: ModelConfig) -> int:
    """One layer's attention weights: q/k/v/o, or MLA's query path, latent projection,
    kv_b_proj (W_UK and W_UV, read whole by absorbed decode too) and o_proj. DeepSeek-V4's
    differ by the layer's kind: ``v4_roofline.attention_weights``."""
    if cfg.v4 is not None:
        raise ValueError("deepseek_v4: a layer's attention weights depend on its kind")
    hidden, mla = cfg.hidden_size, cfg.mla
    if mla is None:
        q = cfg.num_heads * cfg.head_dim
        kv = cfg.num_kv_heads * cfg.head_dim
        return hidden * (q + 2 * kv) + q * hidden
    heads = cfg.num_heads
    queries = heads * mla.qk_head_dim
    if mla.q_lora_rank is None:
        q_path = hidden * queries
    else:
        q_path = hidden * mla.q_lora_rank + mla.q_lora_rank * queries
    up = mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    return q_path + hidden * mla.latent_dim + up + heads * mla.v_head_dim * hidden


def active_experts(cfg: ModelConfig, batch: int) -> float:
    """Experts a decode step of ``batch`` tokens reads per MoE layer, in expectation under
    uniform routing (random weights): E * (1 - (1 - k / E) ** batch)."""
    assert cfg.moe is not None
    num, top_k = cfg.moe.num_experts, cfg.moe.top_k
    return num * (1 - (1 - top_k / num) ** batch)


def weight_bytes(
    cfg: ModelConfig, element_size: int, batch: int = 1, matmul_element_size: int | None = None
) -> int:
    """Bytes a decode step of ``batch`` sequences reads: layer weights (of an MoE model the
    experts its tokens are routed to) at ``matmul_element_size`` (default element_size; 1 for
    FP8 weights, whose float32 scales add 1/4096 and are not counted), the LM head and the
    norms at element_size (DeepSeek-V4's float32 parameters at 4 bytes, ``v4_roofline``)."""
    if cfg.v4 is not None:
        weights = v4_roofline.v4_weights(cfg, active_experts(cfg, batch))
        return weights.bytes(element_size, matmul_element_size)
    head = cfg.hidden_size * cfg.vocab_size
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size
    experts = active_experts(cfg, batch) if cfg.moe is not None else None
    layers = matmul_params(cfg, experts) * (matmul_element_size or element_size)
    return layers + (head + norms) * element_size


def kv_bytes_per_token(cfg: ModelConfig, element_size: int, scale_values: int = 0) -> int:
    """K and V of every KV head, or MLA's one latent (and RoPE key), over the layers; each row
    with ``scale_values`` more slots for its scale (an FP8 cache's 16, engine/layers/fp8_kv.py).
    DeepSeek-V4: the compressed entries' share of a token (``v4_roofline``)."""
    if cfg.v4 is not None:
        return v4_roofline.kv_bytes_per_token(cfg, element_size)
    if cfg.mla is not None:
        return cfg.num_layers * (cfg.mla.latent_dim + scale_values) * element_size
    return 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim + scale_values) * element_size


def decode_step_bytes(
    cfg: ModelConfig,
    element_size: int,
    batch: int,
    context: int,
    weights: int | None = None,
    kv: tuple[int, int] | None = None,
    matmul_element_size: int | None = None,
) -> int:
    """Weights (``weights`` bytes as held, e.g. GGUF blocks; else weight_bytes; for an MoE
    model always weight_bytes, which counts only the experts the batch's tokens are routed
    to, its projections at ``matmul_element_size``) plus the batch's KV: ``kv`` = (element
    size, scale slots per row) of the cache, default (element_size, 0). A DeepSeek-V4 row
    reads its window and the entries it attends to or scores (``v4_roofline``)."""
    moe = cfg.moe is not None
    if weights is None or moe:
        weights = weight_bytes(cfg, element_size, batch, matmul_element_size)
    kv_element, scale_values = kv or (element_size, 0)
    if cfg.v4 is not None:
        return weights + batch * v4_roofline.kv_read_per_row(cfg, kv_element, context)
    return weights + batch * context * kv_bytes_per_token(cfg, kv_element, scale_values)


def held_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads of the weights as the model holds them: every parameter but
    an input embedding that no LM head shares (its lookups read a few rows), plus what modules
    hold outside their parameters (the bfloat16 weights' packed copies, ``Bf16Linear``)."""
    head = getattr(model, "lm_head", None)
    embed = getattr(model, "embed_tokens", None)
    skip = None
    if embed is not None and head is not None and embed.weight is not head.weight:
        skip = embed.weight
    params = (p for p in model.parameters() if p is not skip)
    held = sum(m.held_bytes() for m in model.modules() if isinstance(m, Bf16Linear))
    return sum(p.numel() * p.element_size() for p in params) + held


def prefill_flops(cfg: ModelConfig, tokens: int) -> float:
    """FLOPs of one causal prefill of `tokens` tokens (logits for the last token only)."""
    if cfg.v4 is not None:
        return v4_roofline.prefill_flops(cfg, tokens)
    linear = 2.0 * matmul_params(cfg) * tokens + 2.0 * cfg.hidden_size * cfg.vocab_size
    mla = cfg.mla
    dims = 2 * cfg.head_dim if mla is None else mla.qk_head_dim + mla.v_head_dim
    attention = 2.0 * cfg.num_layers * cfg.num_heads * dims * tokens * tokens / 2
    return linear + attention

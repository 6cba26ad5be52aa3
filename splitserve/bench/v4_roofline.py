"""DeepSeek-V4's side of the roofline (``roofline.py`` calls it where ``cfg.v4`` is set): the
weights a decode step reads, the cache a decode row reads, and a prefill's FLOPs.

Weights, by how the model holds them (``engine/models/deepseek_v4.py``): the projections
(attention, compressors, indexer, experts) at the matmul element size; the norms and the LM
head at the model's; the float32 parameters (attention sinks, the compressors' position
biases, the hyper-connections, the routers and their biases) at 4 bytes. The embedding and
the hash layers' ``tid2eid`` tables are lookups of a few rows and are not counted.

A decode row at context c reads, per layer, its window's keys (min(c, window)); a CSA layer
also every closed entry's index key (c // csa_rate, the lightning indexer scores them all)
and the min(c // csa_rate, index_topk) entries it picked; an HCA layer every closed entry
(c // hca_rate). Not counted: the state rows that a closing window pools (2 rate rows, once
every rate tokens) and the step's writes.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.model_config import ModelConfig, MoEConfig
from splitserve.engine.v4_config import V4Config

FLOAT32 = 4


@dataclass(frozen=True)
class V4Weights:
    """Values of the decoder's weights by the element size they are read at."""

    matmul: float
    """Projections: attention, compressors, indexer, and the experts counted."""
    norms: int
    """RMSNorm weights and the LM head, at the model's element size."""
    float32: int
    """Sinks, position biases, hyper-connections, routers and their biases."""

    def bytes(self, element_size: int, matmul_element_size: int | None = None) -> int:
        matmul = self.matmul * (matmul_element_size or element_size)
        return round(matmul + self.norms * element_size + self.float32 * FLOAT32)


def _v4(cfg: ModelConfig) -> tuple[V4Config, MoEConfig]:
    assert cfg.v4 is not None and cfg.moe is not None
    return cfg.v4, cfg.moe


def attention_weights(cfg: ModelConfig, kind: str) -> V4Weights:
    """One layer's attention: the low-rank query path, the shared key, the grouped low-rank
    output; a compressor in CSA and HCA layers, the lightning indexer in CSA ones."""
    v4, hidden, heads = cfg.v4, cfg.hidden_size, cfg.num_heads
    assert v4 is not None
    dim, rank, index_dim = v4.head_dim, v4.q_lora_rank, v4.index_head_dim
    matmul = hidden * rank + rank * heads * dim + hidden * dim
    matmul += v4.o_lora_rank * heads * dim + v4.o_groups * v4.o_lora_rank * hidden
    norms, float32 = rank + dim, heads
    if kind != "sliding":
        width = 2 * dim if kind == "csa" else dim
        matmul += 2 * hidden * width
        norms += dim
        float32 += v4.rate(kind) * width
    if kind == "csa":
        matmul += 4 * hidden * index_dim + rank * v4.index_heads * index_dim
        matmul += hidden * v4.index_heads
        norms += index_dim
        float32 += v4.csa_rate * 2 * index_dim
    return V4Weights(matmul, norms, float32)


def v4_weights(cfg: ModelConfig, experts: float | None = None) -> V4Weights:
    """The decoder's weights with ``experts`` routed experts per MoE layer (default: top_k,
    what one token multiplies) beside the shared one, the LM head and the last
    hyper-connection collapse."""
    v4, moe = _v4(cfg)
    hidden, streams = cfg.hidden_size, v4.hc_mult
    routed = moe.top_k if experts is None else experts
    mix = (2 + streams) * streams
    matmul = 3 * hidden * (routed * moe.intermediate_size + moe.shared_intermediate_size)
    per_layer = V4Weights(
        matmul=matmul * cfg.num_layers,
        norms=2 * hidden * cfg.num_layers,
        float32=(2 * (mix * streams * hidden + mix + 3) + moe.num_experts * hidden)
        * cfg.num_layers,
    )
    biased = cfg.num_layers - len(moe.hash_layers)  # the top-k layers' correction bias
    layers = [attention_weights(cfg, kind) for kind in v4.layer_kinds[: cfg.num_layers]]
    head = hidden * cfg.vocab_size + hidden
    return V4Weights(
        matmul=per_layer.matmul + sum(w.matmul for w in layers),
        norms=per_layer.norms + sum(w.norms for w in layers) + head,
        float32=per_layer.float32
        + sum(w.float32 for w in layers)
        + biased * moe.num_experts
        + streams * streams * hidden
        + streams
        + 1,
    )


def kv_bytes_per_token(cfg: ModelConfig, element_size: int) -> int:
    """What a token leaves in the cache for good: its share of the compressed entries (and
    CSA's index keys), every compressed layer's; the window's keys and the compressors'
    state rows are a sequence's last ``window`` and ``2 rate`` tokens' only."""
    v4, _ = _v4(cfg)
    values = 0
    for kind in v4.layer_kinds[: cfg.num_layers]:
        if kind != "sliding":
            index_key = v4.index_head_dim if kind == "csa" else 0
            values += (v4.head_dim + index_key) // v4.rate(kind)
    return values * element_size


def kv_read_per_row(cfg: ModelConfig, element_size: int, context: int) -> int:
    """Bytes of the cache a decode row at ``context`` reads over the layers: its window's
    keys, a CSA layer's index keys (all scored) and picked entries, an HCA layer's entries."""
    v4, _ = _v4(cfg)
    values = 0
    for kind in v4.layer_kinds[: cfg.num_layers]:
        values += min(context, v4.window) * v4.head_dim
        closed = context // v4.rate(kind) if kind != "sliding" else 0
        if kind == "csa":
            values += closed * v4.index_head_dim + min(closed, v4.index_topk) * v4.head_dim
        elif kind == "hca":
            values += closed * v4.head_dim
    return values * element_size


def attention_flops(cfg: ModelConfig, tokens: int) -> float:
    """A causal prefill's attention over the layers: each query's heads against (scores) and
    over (output) its window's keys and its visible entries (a CSA layer's picked ones), and
    in a CSA layer the indexer's heads scoring every closed entry."""
    v4, _ = _v4(cfg)
    per_key = 4.0 * cfg.num_heads * v4.head_dim
    per_scored = 2.0 * v4.index_heads * v4.index_head_dim
    flops = 0.0
    for kind in v4.layer_kinds[: cfg.num_layers]:
        keys = _sum_over_queries(tokens, 1, v4.window)
        if kind == "csa":
            keys += _sum_over_queries(tokens, v4.csa_rate, v4.index_topk)
            flops += per_scored * _sum_over_queries(tokens, v4.csa_rate, tokens)
        elif kind == "hca":
            keys += _sum_over_queries(tokens, v4.hca_rate, tokens)
        flops += per_key * keys
    return flops


def _sum_over_queries(tokens: int, rate: int, cap: int) -> int:
    """sum over the queries' contexts c = 1 .. tokens of min(c // rate, cap)."""
    return sum(min(c // rate, cap) for c in range(1, tokens + 1))


def prefill_flops(cfg: ModelConfig, tokens: int) -> float:
    """FLOPs of one causal prefill of ``tokens`` tokens (logits for the last token only):
    every projection, router and hyper-connection mix per token, plus the attention."""
    weights = v4_weights(cfg)
    head = cfg.hidden_size * cfg.vocab_size
    per_token = weights.matmul + mixes(cfg)
    return 2.0 * per_token * tokens + 2.0 * head + attention_flops(cfg, tokens)


def mixes(cfg: ModelConfig) -> int:
    """The per-token matmul weights held in float32: routers and hyper-connection mixes."""
    v4, moe = _v4(cfg)
    streams, hidden = v4.hc_mult, cfg.hidden_size
    mix = (2 + streams) * streams * streams * hidden
    return cfg.num_layers * (2 * mix + moe.num_experts * hidden) + streams * streams * hidden

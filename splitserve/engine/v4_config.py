"""DeepSeek-V4's attention and residual settings, as a ``deepseek_v4`` config describes them.

Every layer attends to a sliding window of its last ``window`` positions (itself included);
a CSA layer (``compressed_sparse_attention``) adds compressed entries, one per ``csa_rate``
tokens pooled over two overlapping windows, of which its lightning indexer keeps the
``index_topk`` best for each query; an HCA layer (``heavily_compressed_attention``) adds one
entry per ``hca_rate`` tokens, all of them visible. The residual is ``hc_mult`` streams mixed
by manifold-constrained hyper-connections. The sliding layers rotate by the ``main`` rope, the
compressed ones (their queries, keys, entries and indexer) by the ``compress`` rope; both rotate
the last ``rope_dim`` values of each head, in interleaved pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KINDS = {
    "sliding_attention": "sliding",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}
_LEGACY_RATIO = {0: "sliding_attention", 4: "compressed_sparse_attention"}


@dataclass(frozen=True)
class Rope:
    theta: float
    scaling: dict[str, Any] | None = None
    """YaRN (``rope_type: yarn``) or None; its attention factor multiplies cos and sin."""


@dataclass(frozen=True)
class V4Config:
    layer_kinds: tuple[str, ...]
    """Per layer: "sliding", "csa" or "hca"."""
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    window: int
    csa_rate: int
    hca_rate: int
    o_groups: int
    o_lora_rank: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_iters: int
    hc_eps: float
    main_rope: Rope
    compress_rope: Rope
    mtp_kind: str = "sliding"
    """The MTP block's kind: the entry past the decoder layers' where the config lists one
    (DeepSeek's release lists ``num_hidden_layers + 1`` compress ratios), else sliding."""

    def __post_init__(self) -> None:
        if any(
            kind not in ("sliding", "csa", "hca") for kind in (*self.layer_kinds, self.mtp_kind)
        ):
            raise ValueError(f"deepseek_v4 layer kinds: {self.layer_kinds}")
        if self.rope_dim % 2 or not 0 < self.rope_dim <= min(self.head_dim, self.index_head_dim):
            raise ValueError("deepseek_v4: the rope part must be even and fit every head")

    def rate(self, kind: str) -> int:
        """Tokens per compressed entry of a layer kind (0: sliding, none)."""
        return {"sliding": 0, "csa": self.csa_rate, "hca": self.hca_rate}[kind]

    def rope(self, kind: str) -> Rope:
        return self.main_rope if kind == "sliding" else self.compress_rope


def v4_from_hf(cfg: dict[str, Any]) -> V4Config:
    """A ``deepseek_v4`` config.json, in transformers' form (``layer_types``,
    ``compress_rates``, ``rope_parameters`` with ``main`` and ``compress``) or with the older
    keys transformers folds in (``compress_ratios``, ``compress_rate_csa`` / ``_hca``,
    ``qk_rope_head_dim``, a flat ``rope_scaling``)."""
    layers = cfg["num_hidden_layers"]
    rates = dict(cfg.get("compress_rates") or {})
    csa = int(cfg.get("compress_rate_csa") or rates.get("compressed_sparse_attention", 4))
    hca = int(cfg.get("compress_rate_hca") or rates.get("heavily_compressed_attention", 128))
    types = cfg.get("layer_types")
    if types is None and cfg.get("compress_ratios") is not None:
        ratio = _LEGACY_RATIO | {hca: "heavily_compressed_attention"}
        types = [ratio[r] for r in cfg["compress_ratios"]]
    if types is None:  # transformers' default: two HCA layers, then CSA and HCA alternating
        types = ["heavily_compressed_attention"] * min(layers, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
            for i in range(max(layers - 2, 0))
        ]
    head_dim = cfg["head_dim"]
    rope_dim = cfg.get("qk_rope_head_dim")
    if rope_dim is None:
        rope_dim = int(head_dim * (cfg.get("partial_rotary_factor") or 64 / 512))
    main, compress = _ropes(cfg)
    return V4Config(
        layer_kinds=tuple(KINDS[t] for t in types[:layers]),
        head_dim=head_dim,
        rope_dim=int(rope_dim),
        q_lora_rank=cfg["q_lora_rank"],
        window=int(cfg.get("sliding_window") or 128),
        csa_rate=csa,
        hca_rate=hca,
        o_groups=cfg["o_groups"],
        o_lora_rank=cfg["o_lora_rank"],
        index_heads=cfg["index_n_heads"],
        index_head_dim=cfg["index_head_dim"],
        index_topk=cfg["index_topk"],
        hc_mult=cfg["hc_mult"],
        hc_iters=cfg.get("hc_sinkhorn_iters", 20),
        hc_eps=float(cfg.get("hc_eps", 1e-6)),
        main_rope=main,
        compress_rope=compress,
        mtp_kind=KINDS[types[layers]] if len(types) > layers else "sliding",
    )


def _ropes(cfg: dict[str, Any]) -> tuple[Rope, Rope]:
    """The main rope has no scaling; the compress rope takes the config's YaRN, whose
    attention factor is 1 unless the config sets one (as transformers)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    main = params.get("main")
    if isinstance(main, dict):
        compress = dict(params["compress"])
        main_theta = float(main.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    else:
        compress = {k: v for k, v in params.items() if k not in ("main", "compress")}
        compress["rope_theta"] = cfg.get("compress_rope_theta", 160000.0)
        main_theta = float(cfg.get("rope_theta", 10000.0))
    kind = compress.get("rope_type", compress.get("type", "default"))
    scaling = None
    if kind == "yarn":
        scaling = {"attention_factor": 1.0} | compress
    elif kind != "default":
        raise ValueError(f"deepseek_v4: unsupported compress rope {kind!r}")
    return Rope(main_theta), Rope(float(compress["rope_theta"]), scaling)

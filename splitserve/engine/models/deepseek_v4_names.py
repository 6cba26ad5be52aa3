"""DeepSeek-V4 checkpoint tensor names -> the names of transformers' modules, which
``models/deepseek_v4.py`` follows.

DeepSeek's release names its tensors its own way (``layers.3.attn.wq_a.weight``,
``layers.3.ffn.experts.7.w1.weight``, ``hc_head_fn``); transformers writes them back in that
form (under ``model.``, with ``embed_tokens`` and ``hc_head.*`` as its own) and holds them as
``layers.3.self_attn.q_a_proj.weight`` etc., the routed experts stacked
(``mlp.experts.gate_up_proj`` [E, 2I, H]). Every form comes out here as transformers' module
names, with the experts one by one (``mlp.experts.7.gate_proj.weight``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

_PARTS = {
    "attn": "self_attn",
    "ffn": "mlp",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_sink": "sinks",
    "norm": "kv_norm",  # inside a layer: the attention's and the compressors' norms
    "ape": "position_bias",
    "wq_a": "q_a_proj",
    "wq_b": "q_b_proj",
    "wkv": "kv_proj",
    "wgate": "gate_proj",
    "wo_a": "o_a_proj",
    "wo_b": "o_b_proj",
    "q_norm": "q_a_norm",
    "w1": "gate_proj",
    "w2": "down_proj",
    "w3": "up_proj",
}
_TOP = {"embed": "embed_tokens", "head": "lm_head"}
_HC = {"hc_attn": "attn_hc", "hc_ffn": "ffn_hc", "hc_head": "hc_head"}


def module_name(name: str) -> str | None:
    """A checkpoint name in any of the forms -> transformers' (None: the MTP layer's)."""
    parts = name.removeprefix("model.").split(".")
    if parts[0] == "mtp":
        return None
    parts[0] = _TOP.get(parts[0], parts[0])
    if parts[0] == "layers":
        parts[1:] = [_PARTS.get(part, part) for part in parts[1:]]
    name = ".".join(_hyper_connection(part) for part in parts)
    name = name.replace(".self_attn.indexer.compressor.", ".self_attn.compressor.indexer.")
    name = name.replace(".self_attn.indexer.", ".self_attn.compressor.indexer.")
    name = name.replace(".indexer.scorer.", ".indexer.")
    return name.replace(".mlp.gate.bias", ".mlp.gate.e_score_correction_bias")


def _hyper_connection(part: str) -> str:
    """``hc_attn_fn`` -> ``attn_hc.fn``, ``hc_head_fn`` -> ``hc_head.hc_fn``."""
    for prefix, module in _HC.items():
        if part.startswith(prefix + "_"):
            tail = part.removeprefix(prefix + "_")
            return f"{module}.{'hc_' + tail if module == 'hc_head' else tail}"
    return part


def module_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under ``module_name``, stacked experts split one by one."""
    for name, tensor in weights:
        target = module_name(name)
        if target is None:
            continue
        stem, _, last = target.rpartition(".")
        if stem.endswith(".mlp.experts") and last == "gate_up_proj":
            for expert, rows in enumerate(tensor):
                gate, up = rows.chunk(2, dim=0)
                yield f"{stem}.{expert}.gate_proj.weight", gate
                yield f"{stem}.{expert}.up_proj.weight", up
        elif stem.endswith(".mlp.experts") and last == "down_proj":
            for expert, rows in enumerate(tensor):
                yield f"{stem}.{expert}.down_proj.weight", rows
        else:
            yield target, tensor

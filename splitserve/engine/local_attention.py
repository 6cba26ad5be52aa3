"""Layers that attend to a sliding window (Gemma 3's local layers), as checkpoints describe them.

Gemma 3 interleaves local layers, each query seeing its last ``window`` positions (itself
included), with global ones that see the whole context: 5 local to 1 global in its released
sizes. A Hugging Face config lists every layer's kind (``layer_types``) or gives the period of
the pattern (``sliding_window_pattern``, every n-th layer global); a GGUF file gives the window
only, and llama.cpp fixes the period at 6. The local layers' rotary has its own base
(``rope_local_base_freq``, 10,000 in every size) and no scaling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GEMMA3_PATTERN = 6
"""Every 6th layer is global (Gemma 3's default, and what llama.cpp assumes for its files)."""
GEMMA3_LOCAL_THETA = 10000.0


@dataclass(frozen=True)
class LocalAttention:
    window: int
    layers: tuple[int, ...]
    """The decoder layers that attend to the window; the others attend to everything."""
    rope_theta: float

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError("a sliding window holds at least one position")


def pattern_layers(num_layers: int, period: int) -> tuple[int, ...]:
    """The local layers when every ``period``-th layer is global."""
    return tuple(i for i in range(num_layers) if (i + 1) % period)


def gemma3_from_hf(cfg: dict[str, Any]) -> tuple[LocalAttention, float, dict[str, Any] | None]:
    """(the local layers, the global layers' rope theta, their rope scaling or None) of a
    ``gemma3_text`` config, in transformers 5's form (``rope_parameters`` per layer kind) or
    the form the Hub's configs still have (``rope_theta``, ``rope_local_base_freq``,
    ``rope_scaling``)."""
    params = cfg.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or cfg.get("rope_scaling") or {})
    local = params.get("sliding_attention") or {}
    theta = float(full.pop("rope_theta", cfg.get("rope_theta", 1_000_000.0)))
    kind = full.get("rope_type", full.get("type", "default"))
    types = cfg.get("layer_types")
    if types is None:
        layers = pattern_layers(cfg["num_hidden_layers"], cfg.get("sliding_window_pattern", 6))
    else:
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    local_theta = local.get("rope_theta", cfg.get("rope_local_base_freq", GEMMA3_LOCAL_THETA))
    window = LocalAttention(int(cfg.get("sliding_window") or 4096), layers, float(local_theta))
    return window, theta, None if kind == "default" else full

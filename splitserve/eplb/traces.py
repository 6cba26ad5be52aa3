"""Expert-load traces: ``[steps, layers, experts]`` int64 counts of (token, slot) pairs.

Synthetic ones draw each token's top_k distinct experts from a Zipf popularity (Gumbel top-k,
i.e. sampling without replacement in proportion to the weights): expert ranked r in a layer has
weight 1 / (r + 1) ** exponent, the ranking a random permutation per layer. A drifting trace
rotates the ranking by one place every ``1 / drift`` steps: every expert climbs one place and
the hottest drops to the coldest, so the hot set changes while the system serves. Recorded
traces come from the engine (``EngineConfig.record_expert_load``, ``engine/expert_load.py``)
and are saved as JSON; a served worker writes its own in parts (``expert_load_dir``), which
``load_served`` puts together.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch


def zipf_trace(
    num_experts: int,
    top_k: int,
    tokens_per_step: int,
    steps: int,
    layers: int = 1,
    exponent: float = 1.0,
    drift: float = 0.0,
    seed: int = 0,
) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    ranking = torch.stack([torch.randperm(num_experts, generator=generator) for _ in range(layers)])
    trace = torch.zeros((steps, layers, num_experts), dtype=torch.int64)
    for step in range(steps):
        shifted = (ranking - int(step * drift)) % num_experts
        log_weights = -exponent * torch.log1p(shifted.float())
        uniform = torch.rand((layers, tokens_per_step, num_experts), generator=generator)
        gumbel = -torch.log(-torch.log(uniform.clamp(min=1e-30)))
        chosen = torch.topk(log_weights[:, None, :] + gumbel, top_k, dim=-1).indices.flatten(1)
        trace[step].scatter_add_(1, chosen, torch.ones_like(chosen))
    return trace


def save_trace(trace: torch.Tensor, path: Path) -> None:
    """JSON: {"shape": [steps, layers, experts], "counts": nested lists}."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"shape": list(trace.shape), "counts": trace.tolist()}))


def load_trace(path: Path) -> torch.Tensor:
    data = json.loads(path.read_text())
    trace = torch.tensor(data["counts"], dtype=torch.int64)
    if list(trace.shape) != data["shape"] or trace.dim() != 3:
        raise ValueError(f"{path}: counts of shape {list(trace.shape)}, header {data['shape']}")
    return trace


def load_served(directory: Path) -> torch.Tensor:
    """The expert load that served workers wrote to ``directory``
    (``<worker id>-g<generation>-<part>.json``, ``EngineConfig.expert_load_dir``): each
    worker's parts joined in order (a restarted worker's after its earlier generation's),
    then the workers' steps added up, cut to the fewest steps. The ranks of an
    expert-parallel group step together, so their sum is the group's load per step; the
    steps of independent workers are paired by index."""
    parts: dict[str, list[tuple[int, int, Path]]] = {}
    for path in directory.glob("*.json"):
        match = re.fullmatch(r"(.+)-g(\d+)-(\d+)\.json", path.name)
        if match is not None:
            parts.setdefault(match[1], []).append((int(match[2]), int(match[3]), path))
    if not parts:
        raise ValueError(f"{directory}: no <worker id>-g<generation>-<part>.json files")
    workers = [
        torch.cat([load_trace(path) for *_, path in sorted(files)]) for files in parts.values()
    ]
    if len({w.shape[1:] for w in workers}) != 1:
        raise ValueError(f"{directory}: the workers' layers and experts differ")
    steps = min(len(w) for w in workers)
    return torch.stack([w[:steps] for w in workers]).sum(dim=0)

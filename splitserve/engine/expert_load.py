"""Per-step expert load of an MoE model, the input of expert-parallel load balancing (EPLB).

Every MoE layer counts, on its device, the (token, slot) pairs routed to each expert
(``SparseMoE.expert_load``). The engine calls ``mark_step`` before each step's forward: the
counts since the previous mark (the step before) are copied aside on the device and zeroed,
with no read back to the host, so recording costs a copy per step and no synchronization,
also under overlapped scheduling and CUDA graphs (where padded rows count too). ``take``
moves the recorded steps to the host: ``[steps, MoE layers, experts]`` int64.
"""

from __future__ import annotations

from typing import Protocol

import torch


class CountsExpertLoad(Protocol):
    def expert_load(self) -> torch.Tensor: ...

    def reset_expert_load(self) -> None: ...


class ExpertLoadRecorder:
    """Records nothing unless ``enabled`` (``EngineConfig.record_expert_load``)."""

    def __init__(self, model: object, enabled: bool = True) -> None:
        self.enabled = enabled
        if enabled and not hasattr(model, "expert_load"):
            raise ValueError("recording the expert load needs a mixture-of-experts model")
        self.model: CountsExpertLoad = model  # type: ignore[assignment]
        if enabled:
            self.model.reset_expert_load()  # what warm-up and graph capture routed
        self._steps: list[torch.Tensor] = []
        self._marked = False

    def mark_step(self) -> None:
        """A step begins: what was routed since the last mark is the step before's load."""
        if not self.enabled:
            return
        if self._marked:
            self._steps.append(self.model.expert_load().clone())
            self.model.reset_expert_load()
        self._marked = True

    @property
    def recorded(self) -> int:
        """Steps recorded and not taken yet, the last one (still counting) included."""
        return len(self._steps) + int(self._marked)

    def take(self) -> torch.Tensor:
        """The loads of the steps recorded so far, the last one included; clears them."""
        if not self.enabled:
            raise ValueError("the expert load is not recorded (record_expert_load=False)")
        self.mark_step()
        steps, self._steps, self._marked = self._steps, [], False
        if not steps:
            return torch.zeros((0, *self.model.expert_load().shape), dtype=torch.int64)
        return torch.stack(steps).cpu()

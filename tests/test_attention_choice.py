"""The default attention backend (issue 46): ``auto`` is the fastest correct path for the
device, Triton's kernels on CUDA where Triton is installed, torch elsewhere; an explicit
choice is kept."""

from __future__ import annotations

import pytest

from splitserve.engine.config import EngineConfig
from splitserve.engine.layers.attention import TorchAttention
from splitserve.engine.layers.attention_backends import choose_backend
from splitserve.engine.llm import LLM


@pytest.mark.parametrize(
    ("name", "device", "triton", "chosen"),
    [
        ("auto", "cuda", True, "triton"),
        ("auto", "cuda", False, "torch"),
        ("auto", "cpu", True, "torch"),
        ("auto", "npu", True, "torch"),
        ("torch", "cuda", True, "torch"),
        ("triton", "cpu", True, "triton"),
    ],
)
def test_auto_picks_triton_on_cuda_with_triton_and_torch_elsewhere(
    name: str, device: str, triton: bool, chosen: str
) -> None:
    assert choose_backend(name, device, triton) == chosen


def test_engines_default_to_auto_and_a_cpu_engine_runs_torch_attention(smollm2_llm: LLM) -> None:
    assert EngineConfig().attention_backend == "auto"
    with pytest.raises(ValueError, match="attention_backend must be auto, torch or triton"):
        EngineConfig(attention_backend="flash")
    model = smollm2_llm.engine.runner.model
    backends = {type(m.backend) for m in model.modules() if hasattr(m, "backend")}
    assert backends == {TorchAttention}

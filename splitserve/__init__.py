"""splitserve: disaggregated LLM serving.

``from splitserve import LLM, SamplingParams`` is the offline API; the names load lazily so
that the CLI and the API server do not import torch before they need it.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "splitserve.engine.llm",
    "LLMEngine": "splitserve.engine.llm_engine",
    "SamplingParams": "splitserve.engine.sampling_params",
    "StructuredOutputsParams": "splitserve.engine.sampling_params",
    "RequestOutput": "splitserve.engine.request",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'splitserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

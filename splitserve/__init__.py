"""splitserve: disaggregated LLM serving."""

from splitserve.engine.llm import LLM
from splitserve.engine.request import RequestOutput, SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]

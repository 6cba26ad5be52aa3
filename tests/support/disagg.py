"""What the disaggregated end-to-end tests share: prompts, references, requests by hand."""

from __future__ import annotations

import json
from typing import Any

import httpx

from splitserve.engine.llm import LLM
from splitserve.engine.sampling_params import SamplingParams

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 16
TOPICS = ["rivers", "prime numbers", "the moon", "bread", "chess", "volcanoes", "tea", "owls"]
PROMPTS = [
    f"Prompt {i}. Tell me one short fact about {TOPICS[i % len(TOPICS)]}. " + "Be brief. " * (i % 9)
    for i in range(30)
]
Reference = tuple[str, list[str], str | None]
"""A prompt's greedy output: its text, one decoded string per token, its finish reason."""


def reference(llm: LLM, prompts: list[str]) -> list[Reference]:
    """Colocated greedy outputs, one per prompt."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)
    result = []
    for out in llm.generate(prompts, params, use_tqdm=False):
        c = out.outputs[0]
        assert c.logprobs is not None
        tokens = [
            _token_text(llm, lp[t].decoded_token, t)
            for lp, t in zip(c.logprobs, c.token_ids, strict=True)
        ]
        result.append((c.text, tokens, c.finish_reason))
    return result


def _token_text(llm: LLM, decoded: str | None, token_id: int) -> str:
    return decoded if decoded is not None else str(llm.engine.tokenizer.decode([token_id]))


def completions(url: str, prompts: list[str], stream: bool) -> list[tuple[str, list[str], str]]:
    """One /v1/completions request for all prompts (greedy, logprobs=0), per prompt."""
    body = {
        "model": MODEL,
        "prompt": prompts,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": 0,
        "stream": stream,
    }
    if not stream:
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
        assert response.status_code == 200, response.text
        return [
            (c["text"], c["logprobs"]["tokens"], c["finish_reason"])
            for c in response.json()["choices"]
        ]
    texts = [""] * len(prompts)
    tokens: list[list[str]] = [[] for _ in prompts]
    finish: list[Any] = [None] * len(prompts)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            assert "error" not in event, event
            for c in event["choices"]:
                texts[c["index"]] += c["text"]
                tokens[c["index"]] += (c["logprobs"] or {}).get("tokens", [])
                finish[c["index"]] = c["finish_reason"] or finish[c["index"]]
    return list(zip(texts, tokens, finish, strict=True))


def kv_bytes(llm: LLM, num_prompt_tokens: int) -> int:
    """layers x 2 x tokens (rounded up to whole blocks) x kv_heads x head_dim x dtype size."""
    cfg, engine = llm.engine.model_config, llm.engine
    block = engine.config.block_size
    tokens = -(-num_prompt_tokens // block) * block
    element = engine.runner.kv_cache.element_size()
    return cfg.num_layers * 2 * tokens * cfg.num_kv_heads * cfg.head_dim * element

"""FP8 weights and the FP8 KV cache against float32, on SmolLM2-135M-Instruct's real weights.

The reference is the float32 engine (``dtype="float32"``: the GGUF file's weights
dequantized). Each of the 32 chat prompts below is continued by the reference with its 8
greedy tokens (EOS ignored): 256 continuations. Every mode then reads each prompt with its
continuation in one prefill (teacher-forced, prefix caching off), and its next-token
distribution at each of the 8 continuation positions is compared with the reference's: top-1
agreement and mean KL(reference || mode) in nats. With an FP8 KV cache a prefill attends to
its own K/V as the cache gives them back (engine/layers/fp8_kv.py), so these positions see
what decode steps would read. Modes:

- ``fp8-weights``: ``quantization="fp8"`` (e4m3 128 x 128 blocks; products of up to 64 rows,
  decode steps and these short prefills, take the rows unquantized (W8A16), longer ones
  quantize them per token and 128-channel group; the CPU path is the dequantizing reference);
- ``fp8-weights-w8a8``: the same with every product's rows quantized (what prefills of more
  than 64 tokens compute);
- ``fp8-kv``: ``kv_cache_dtype="fp8"`` (e4m3 values, one float32 scale per token and head);
- ``fp8-both``: the two together.

Also recorded: each mode's greedy answers (up to 32 tokens, to EOS) to the first 6 prompts,
its KV cache bytes per token and its decoder layers' parameter bytes.

    python -m benchmarks.cpu.fp8_quality --out fp8-quality.json
"""

from __future__ import annotations

import argparse
import json
import platform
from typing import Any

import torch

from splitserve.bench.report import git_commit
from splitserve.engine.config import EngineConfig
from splitserve.engine.layers import fp8_linear
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams

MODEL = "smollm2-135m-instruct"
W8A16_DEFAULT = fp8_linear.W8A16_MAX_ROWS
CONTINUATION, ANSWER_TOKENS, CHATS = 8, 32, 6
MODES: dict[str, dict[str, Any]] = {
    "float32": {},
    "fp8-weights": {"quantization": "fp8"},
    "fp8-weights-w8a8": {"quantization": "fp8", "w8a16_max_rows": 0},
    "fp8-kv": {"kv_cache_dtype": "fp8"},
    "fp8-both": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}
PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How do I boil an egg?",
    "Explain photosynthesis to a child.",
    "Give me three tips for better sleep.",
    "What is the difference between a list and a tuple in Python?",
    "Why is the sky blue?",
    "Suggest a name for a friendly robot.",
    "How many legs does a spider have?",
    "Write a short poem about autumn leaves.",
    "What should I pack for a weekend hiking trip?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What are the primary colors?",
    "How does a bicycle stay upright?",
    "Translate 'good morning' into Spanish.",
    "What is a prime number?",
    "Describe the taste of a lemon.",
    "Give me a recipe idea for dinner with rice and beans.",
    "What causes rain?",
    "How can I learn to play the guitar?",
    "What is the largest planet in our solar system?",
    "Write a polite email declining a meeting invitation.",
    "Why do cats purr?",
    "What is machine learning in simple terms?",
    "List three benefits of regular exercise.",
    "How do bees make honey?",
    "What is the boiling point of water at sea level?",
    "Tell me a fun fact about octopuses.",
    "How do I make a cup of tea?",
    "What is the Pythagorean theorem?",
    "Recommend a hobby for someone who likes being outdoors.",
    "Why do we have seasons?",
)


def make_engine(overrides: dict[str, Any]) -> LLMEngine:
    overrides = dict(overrides)
    fp8_linear.W8A16_MAX_ROWS = overrides.pop("w8a16_max_rows", W8A16_DEFAULT)
    config = EngineConfig(
        model=MODEL, dtype="float32", max_model_len=512, max_num_batched_tokens=512,
        max_num_seqs=8, kv_cache_bytes=256 << 20, enable_prefix_caching=False, **overrides,
    )  # fmt: skip
    return LLMEngine(config)


def prompt_ids(engine: LLMEngine, text: str) -> list[int]:
    chat = [{"role": "user", "content": text}]
    ids = engine.tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


def generate(
    engine: LLMEngine, prompts: list[list[int]], tokens: int, ignore_eos: bool = True
) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=ignore_eos)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            out[output.request_id] = list(output.outputs[0].token_ids)
    return [out[str(i)] for i in range(len(prompts))]


def continuation_logits(engine: LLMEngine, ids: list[int], length: int) -> torch.Tensor:
    """The next-token logits at the last ``length`` positions before the end of ids (those
    that predict its last ``length`` tokens), from one teacher-forced prefill."""
    model = engine.runner.model
    forward, kept = model.forward, []

    def keep(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = forward(*args, **kwargs)
        kept.append(out.clone())
        return out

    model.forward = keep  # type: ignore[method-assign]
    try:
        generate(engine, [ids], 1)
    finally:
        del model.forward
    hidden = torch.cat(kept)[len(ids) - 1 - length : len(ids) - 1]
    with torch.inference_mode():
        return model.compute_logits(hidden).float()


def compare(reference: torch.Tensor, got: torch.Tensor) -> dict[str, float]:
    ref, new = reference.log_softmax(-1), got.log_softmax(-1)
    kl = (ref.exp() * (ref - new)).sum(-1)
    return {
        "continuations": int(ref.shape[0]),
        "top1_agreement": (ref.argmax(-1) == new.argmax(-1)).float().mean().item(),
        "mean_kl": kl.mean().item(),
        "max_kl": kl.max().item(),
    }


def projection_bytes(engine: LLMEngine) -> int:
    """The decoder layers' parameter bytes (projections, experts and their scales, norms)."""
    layers = engine.runner.model.layers
    return sum(p.numel() * p.element_size() for p in layers.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    reference = make_engine({})
    prompts = [prompt_ids(reference, text) for text in PROMPTS]
    continued = [p + c for p, c in zip(prompts, generate(reference, prompts, CONTINUATION))]
    ref_logits = torch.cat([continuation_logits(reference, ids, CONTINUATION) for ids in continued])
    modes: dict[str, Any] = {}
    for mode, overrides in MODES.items():
        engine = reference if mode == "float32" else make_engine(overrides)
        logits = torch.cat([continuation_logits(engine, ids, CONTINUATION) for ids in continued])
        answers = generate(engine, prompts[:CHATS], ANSWER_TOKENS, ignore_eos=False)
        modes[mode] = {
            "config": overrides,
            **compare(ref_logits, logits),
            "kv_bytes_per_token": engine.runner.kv_bytes_per_block() // engine.config.block_size,
            "decoder_layer_bytes": projection_bytes(engine),
            "answers": [engine.tokenizer.decode(a) for a in answers],
        }
        print(f"{mode:<12} top1 {modes[mode]['top1_agreement']:.4f} "
              f"KL {modes[mode]['mean_kl']:.2e} kv B/token {modes[mode]['kv_bytes_per_token']} "
              f"layer bytes {modes[mode]['decoder_layer_bytes']}", flush=True)  # fmt: skip
    record = {
        "benchmark": "fp8_quality", "model": MODEL, "commit": git_commit(),
        "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "prompts": list(PROMPTS), "continuation_tokens": CONTINUATION,
        "reference": "dtype=float32", "modes": modes,
    }  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()

"""Decode speed under a JSON schema against unconstrained decode, same engine, same run.

For each batch size, the same prompts run twice, unconstrained and under SCHEMA (greedy, the
batch admitted and prefilled first); the timed window is --steps decode steps in steady state
(every request decoding, none finishing: SCHEMA's minimum length lies beyond the window),
alternated --repeats times, the best of each kept. A
random shape has no vocabulary: its constraint runs over a synthetic one of the model's size
(256 single bytes, then seeded random strings of JSON characters; the last token is the stop
token). Prints a table and one JSON line last; --out writes the JSON to a file.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

from splitserve.bench.report import emit, header
from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.loader import is_random_shape
from splitserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from splitserve.engine.structured.grammar import GrammarCompiler

SCHEMA = {
    "type": "array",
    "minItems": 100,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0},
            "name": {"type": "string", "maxLength": 12},
            "active": {"type": "boolean"},
        },
        "required": ["id", "name", "active"],
        "additionalProperties": False,
    },
}
JSON_CHARS = 'abcdefghijklmnopqrstuvwxyz0123456789 {}[]":,.-_'


def synthetic_vocabulary(size: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    tokens = [bytes([b]) for b in range(256)]
    while len(tokens) < size - 1:
        tokens.append("".join(rng.choices(JSON_CHARS, k=rng.randint(2, 6))).encode())
    return [*tokens[: size - 1], b"</s>"]


def build(args: argparse.Namespace) -> LLMEngine:
    settings: dict[str, Any] = {"max_num_seqs": max(args.batch), "max_model_len": 2048}
    if args.device.startswith("cuda"):
        settings.update(dtype="bfloat16", attention_backend="triton")
    engine = LLMEngine(EngineConfig(args.model, device=args.device, **settings))
    if is_random_shape(args.model):
        size = engine.model_config.vocab_size
        engine.grammar_compiler = GrammarCompiler.from_vocabulary(
            synthetic_vocabulary(size), [size - 1]
        )
    return engine


def prompts(engine: LLMEngine, count: int, length: int) -> list[list[int]]:
    if is_random_shape(engine.config.model):
        rng = random.Random(1)
        vocab = engine.model_config.vocab_size
        return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]
    return [
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"List {i + 3} users of a web shop as JSON."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for i in range(count)
    ]


def measure(engine: LLMEngine, batch: int, steps: int, constrained: bool, tag: str) -> dict:
    """Steady-state decode tok/s of ``batch`` requests over ``steps`` engine steps."""
    spec = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = SamplingParams(
        temperature=0.0, max_tokens=steps + 64, ignore_eos=True, structured_outputs=spec
    )
    ids = [f"{tag}-{batch}-{i}" for i in range(batch)]
    for request_id, prompt in zip(ids, prompts(engine, batch, 256)):
        engine.add_request(request_id, prompt, params)
    requests = [engine.requests[i] for i in ids]
    while any(r.num_output_tokens < 2 for r in requests):
        engine.step()
    phases_before = dict(engine.phases.seconds)
    before = sum(r.num_output_tokens for r in requests)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = time.perf_counter() - start
    tokens = sum(r.num_output_tokens for r in requests) - before
    running = sum(not r.is_finished for r in requests)
    phases = {
        name: round(1e3 * (total - phases_before.get(name, 0.0)) / steps, 3)
        for name, total in engine.phases.seconds.items()
    }
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tok_per_s": tokens / seconds,
        "still_running": running,
        "phases_ms": phases,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    engine = build(args)
    measure(engine, 2, 8, True, "warm")  # compile the grammar, warm the kernels
    measure(engine, 2, 8, False, "warm")
    results = []
    for batch in args.batch:
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(args.repeats):  # alternated, the best of each kept
            for constrained in (False, True):
                tag = "json" if constrained else "free"
                runs[constrained].append(measure(engine, batch, args.steps, constrained, tag))
        free, schema = (max(runs[c], key=lambda r: r["tok_per_s"]) for c in (False, True))
        overhead = 1.0 - schema["tok_per_s"] / free["tok_per_s"]
        results.append(
            {"batch": batch, "unconstrained": free, "json_schema": schema, "overhead": overhead}
        )
        print(
            f"batch {batch:3d}: unconstrained {free['tok_per_s']:9.1f} tok/s, "
            f"json schema {schema['tok_per_s']:9.1f} tok/s, overhead {overhead:6.1%}",
            flush=True,
        )
    config = {**vars(args), "out": str(args.out), "schema": SCHEMA}
    report = {**header(config), "overlapped": engine.runner.overlapped is not None}
    report["results"] = results
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

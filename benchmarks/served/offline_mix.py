"""The offline engine on one serving mix: every prompt submitted at once, output tok/s.

The ceiling a served deployment on one device is compared with (benchmarks/served/
comparison.py): the same engine settings as configs/gpu-colocated.yaml, random token-id
prompts, greedy with ignore_eos so every request writes exactly --output-len tokens. A warm-up
batch runs first so that compile time is not counted. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

from splitserve.engine.llm import LLM
from splitserve.engine.sampling_params import SamplingParams

GPU_ENGINE = {
    "dtype": "bfloat16",
    "attention_backend": "triton",
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
    "gpu_memory_utilization": 0.85,
}
"""configs/gpu-colocated.yaml's engine."""
CPU_ENGINE = {"max_num_seqs": 64, "max_model_len": 2048}


def add_mix_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="shape:llama3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--engine", action="append", default=[], metavar="KEY=VALUE",
        help="an engine setting over the deployment's (e.g. quantization=fp8)",
    )  # fmt: skip


def engine_overrides(settings: list[str]) -> dict[str, Any]:
    """KEY=VALUE settings as EngineConfig keywords (JSON values where they parse: numbers,
    booleans; strings otherwise)."""
    overrides: dict[str, Any] = {}
    for setting in settings:
        key, _, value = setting.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return overrides


def engine_args(device: str) -> dict[str, Any]:
    return dict(GPU_ENGINE if device.startswith("cuda") else CPU_ENGINE)


def warm_mix(llm: LLM, args: argparse.Namespace) -> tuple[list[list[int]], SamplingParams]:
    """The mix's random prompts and greedy ignore-eos params, after a warm-up batch on
    prompts of its own (the timed prompts must not find their KV cached)."""
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    warm = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(8)]
    llm.generate(warm, params, use_tqdm=False)
    return prompts, params


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_mix_arguments(parser)
    args = parser.parse_args()
    settings = engine_args(args.device) | engine_overrides(args.engine)
    llm = LLM(args.model, device=args.device, **settings)
    prompts, params = warm_mix(llm, args)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {
        "prompts": args.prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "seconds": seconds,
        "output_tokens": tokens,
        "output_throughput": tokens / seconds,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

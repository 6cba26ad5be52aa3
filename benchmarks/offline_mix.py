"""The offline engine on one serving mix: every prompt submitted at once, output tok/s.

The ceiling a served deployment on one device is compared with (benchmarks/
served_comparison.py): the same engine settings as configs/gpu-colocated.yaml, random token-id
prompts, greedy with ignore_eos so every request writes exactly --output-len tokens. A warm-up
batch runs first so that compile time is not counted. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from splitserve.engine.llm import LLM
from splitserve.engine.sampling_params import SamplingParams


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="shape:llama3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    gpu = args.device.startswith("cuda")
    engine_args = (
        {"dtype": "bfloat16", "attention_backend": "triton", "max_num_seqs": 256,
         "max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.85}
        if gpu else {"max_num_seqs": 64, "max_model_len": 2048}
    )  # fmt: skip
    llm = LLM(args.model, device=args.device, **engine_args)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    # Warm-up prompts of their own: the timed prompts must not find their KV cached.
    warm = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(8)]
    llm.generate(warm, params, use_tqdm=False)
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

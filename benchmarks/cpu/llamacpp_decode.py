"""llama.cpp (through llama-cpp-python) on a GGUF file: batch-1 greedy decode, steady state.

Runs in the benchmark's own virtual environment (benchmarks/cpu/run.sh installs llama-cpp-python
there, not in the project's): it imports nothing of splitserve. The prompt is the same shape
as `splitserve bench offline` uses (random token ids, --input-len of them); the time per token
counts from the first generated token to the last, so prefill is not in it. Prints one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a GGUF file")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=args.model,
        n_ctx=args.input_len + args.output_len + 16,
        n_batch=512,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        logits_all=False,
        verbose=False,
    )
    rng = random.Random(args.seed)
    vocab = llm.n_vocab()
    runs = []
    for _ in range(args.repeats):
        prompt = [rng.randrange(100, vocab) for _ in range(args.input_len)]
        llm.reset()
        start = time.perf_counter()
        stamps = []
        for _token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) == args.output_len:
                break
        decode_s = stamps[-1] - stamps[0]
        runs.append(
            {
                "prefill_and_first_token_s": stamps[0] - start,
                "decode_tokens_per_s": (len(stamps) - 1) / decode_s,
            }
        )
    best = max(r["decode_tokens_per_s"] for r in runs)
    print(
        json.dumps(
            {
                "engine": "llama.cpp",
                "llama_cpp_python": llama_cpp.__version__,
                "model": os.path.basename(args.model),
                "threads": args.threads,
                "input_len": args.input_len,
                "output_len": args.output_len,
                "runs": runs,
                "decode_tokens_per_s": best,
            }
        )
    )


if __name__ == "__main__":
    main()

"""The price of deterministic mode on the CPU: the default engine and a deterministic one in one
process, timed in turns on the same token ids, in the main thread's CPU time.

Run with ``OMP_NUM_THREADS=1`` (every kernel then runs on the main thread, so its CPU time is
the step's work whatever else loads the machine; wall-clock runs of ``splitserve bench offline
[--deterministic]`` on the shared 2-core VM varied 2x between runs of one mode). Per mode and
case, the best of ``--repeats``: decode tok/s at each batch size (the steps after every prompt
has its first token) and one prompt's prefill tok/s. Prints one JSON object.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.cpu.deterministic
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from splitserve.engine.llm import LLM
from splitserve.engine.sampling_params import SamplingParams


def phases(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
    """CPU seconds of the steps until every prompt has a token, and of the decode steps after."""
    engine = llm.engine
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, params)
    started: set[str] = set()
    prefill = decode = 0.0
    while engine.has_unfinished_requests():
        begin = time.thread_time()
        outputs = engine.step()
        spent = time.thread_time() - begin
        if len(started) < len(prompts):
            prefill += spent
        else:
            decode += spent
        started.update(o.request_id for o in outputs)
    return prefill, decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prefill-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    common = dict(max_num_seqs=max(batches), max_num_batched_tokens=max(2048, args.prefill_len))
    engines = {
        "default": LLM(args.model, enable_prefix_caching=False, **common),
        "deterministic": LLM(args.model, enable_prefix_caching=False, deterministic=True, **common),
    }
    gen = torch.Generator().manual_seed(0)
    vocab = engines["default"].engine.model_config.vocab_size
    cases = {
        f"decode_b{b}": torch.randint(100, vocab, (b, args.input_len), generator=gen)
        for b in batches
    }
    cases["prefill"] = torch.randint(100, vocab, (1, args.prefill_len), generator=gen)
    best: dict[str, dict[str, float]] = {mode: {} for mode in engines}
    for _ in range(args.repeats):
        for case, ids in cases.items():
            for mode, llm in engines.items():  # in turns: both see the same machine
                output_len = 1 if case == "prefill" else args.output_len
                prefill, decode = phases(llm, ids.tolist(), output_len)
                rate = (
                    ids.numel() / prefill
                    if case == "prefill"
                    else (ids.shape[0] * (output_len - 1) / decode)
                )
                best[mode][case] = max(best[mode].get(case, 0.0), rate)
    ratio = {case: best["deterministic"][case] / best["default"][case] for case in cases}
    print(json.dumps({
        "tokens_per_cpu_s": best,
        "deterministic_over_default": ratio,
        "args": vars(args),
        "threads": torch.get_num_threads(),
        "loadavg": os.getloadavg(),
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()

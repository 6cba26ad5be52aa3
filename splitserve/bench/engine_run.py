"""The engine's side of `splitserve bench offline`: a batch submitted at once, the prefill
phase timed until every request has its first token, decode timed over the steady-state window
(``decode_window.py``), with MBU and MFU against the measured and the reference ceilings."""

from __future__ import annotations

import time
from typing import Any

from splitserve.bench.decode_window import StepTokens, steady_window
from splitserve.bench.roofline import (
    Ceilings,
    decode_step_bytes,
    held_weight_bytes,
    prefill_flops,
)
from splitserve.engine.sampling_params import SamplingParams


def run_batch(
    llm: Any, prompts: list[list[int]], output_len: int
) -> tuple[float, list[StepTokens]]:
    """Submit every prompt at once (greedy, ``output_len`` tokens each, EOS ignored) and step
    the engine until all finish: (start time, what each step returned)."""
    engine = llm.engine
    warm = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm.generate([prompts[0][:8]], warm, use_tqdm=False)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{index}", prompt, params)
    start = time.perf_counter()
    steps = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps.append(
            StepTokens(
                time.perf_counter(),
                {out.request_id: len(out.outputs[0].token_ids) for out in outputs},
                frozenset(out.request_id for out in outputs if out.finished),
            )
        )
    return start, steps


def first_tokens_at(steps: list[StepTokens], batch: int) -> float:
    """When the last request of the batch got its first token."""
    started: set[str] = set()
    for step in steps:
        started.update(step.lengths)
        if len(started) == batch:
            return step.at
    raise ValueError(f"only {len(started)} of {batch} requests produced a token")


def engine_throughput(
    llm: Any,
    prompts: list[list[int]],
    output_len: int,
    ceilings: Ceilings,
    reference: Ceilings | None = None,
) -> dict[str, float]:
    """Prefill and steady-state decode rates of one batch. ``*_reference`` shares are against
    ``reference`` (the device's stable ceilings), when given."""
    engine = llm.engine
    start, steps = run_batch(llm, prompts, output_len)
    runner = engine.runner
    cfg, element = engine.model_config, runner.dtype.itemsize
    kv = (runner.kv_cache.element_size(), runner.kv_groups[0].spec.scale_values)
    fp8_weights = engine.config.quantization == "fp8"
    batch, input_len = len(prompts), len(prompts[0])
    prefill_s = first_tokens_at(steps, batch) - start
    flops_per_s = batch * prefill_flops(cfg, input_len) / prefill_s
    stats: dict[str, float] = {
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": batch * input_len / prefill_s,
        "mfu_prefill": flops_per_s / ceilings.matmul_flops_per_s,
    }
    if reference is not None:
        stats["mfu_prefill_reference"] = flops_per_s / reference.matmul_flops_per_s
    if output_len == 1:
        return stats
    window = steady_window(steps, batch)
    context = input_len + window.mean_generated
    weights = held_weight_bytes(runner.model)
    step_bytes = decode_step_bytes(
        cfg, element, batch, round(context), weights, kv, 1 if fp8_weights else None
    )
    bytes_per_s = step_bytes * window.steps / window.seconds
    stats |= {
        "decode_steps": window.steps,
        "decode_tokens": window.tokens,
        "decode_tokens_before_window": window.tokens_before,
        "decode_mean_context": context,
        "decode_step_bytes": step_bytes,
        "decode_s": window.seconds,
        "decode_tokens_per_s": window.tokens / window.seconds,
        "mbu_decode": bytes_per_s / ceilings.bandwidth_bytes_per_s,
    }
    if reference is not None:
        stats["mbu_decode_reference"] = bytes_per_s / reference.bandwidth_bytes_per_s
    return stats

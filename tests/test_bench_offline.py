"""`splitserve bench offline`'s accounting: only steady-state decode counts (every request of
the batch decoding, inside the timed window), shares against the reference ceilings, and one
command that reports the engine, transformers and the compiled peer in one JSON record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from splitserve.bench.decode_window import StepTokens, steady_window
from splitserve.bench.engine_run import engine_throughput
from splitserve.bench.roofline import (
    Ceilings,
    decode_step_bytes,
    matmul_params,
    reference_ceilings,
)
from splitserve.engine.llm import LLM
from splitserve.engine.shapes import shape_config

REPO = Path(__file__).resolve().parents[1]

# Four requests of 16 prompt tokens, 12 output tokens each, a 16-token budget per step: request
# 0 prefills in step 1, request 1 in steps 2-3, 2 in 3-4, 3 in 4-5 while the earlier ones
# decode (steps 1-5 leave them 5, 3, 2 and 1 tokens: 7 decode tokens before the window). Steps
# 6-12 decode all four; request 0 finishes in step 12; then the batch shrinks.
CHUNKED = [
    {"a": 1},
    {"a": 2},
    {"a": 3, "b": 1},
    {"a": 4, "b": 2, "c": 1},
    {"a": 5, "b": 3, "c": 2, "d": 1},
    *({"a": 5 + k, "b": 3 + k, "c": 2 + k, "d": 1 + k} for k in range(1, 8)),
    {"b": 11, "c": 10, "d": 9},
    {"b": 12, "c": 11, "d": 10},
]


def _steps(lengths: list[dict[str, int]], full: int = 12) -> list[StepTokens]:
    return [
        StepTokens(float(i), step, frozenset(r for r, n in step.items() if n == full))
        for i, step in enumerate(lengths, start=1)
    ]


def test_window_counts_batch_times_steps_where_every_request_decodes() -> None:
    window = steady_window(_steps(CHUNKED), batch=4)
    assert (window.steps, window.tokens, window.tokens_before) == (7, 28, 7)
    assert window.seconds == 12.0 - 5.0
    assert window.mean_generated == 11 / 4 + 3


def test_window_skips_overlapped_launches_that_return_no_tokens() -> None:
    with_launches = [*CHUNKED[:5], {}, *CHUNKED[5:9], {}, *CHUNKED[9:]]
    window = steady_window(_steps(with_launches), batch=4)
    assert (window.steps, window.tokens, window.tokens_before) == (7, 28, 7)
    assert window.seconds == 14.0 - 5.0


def test_window_closes_before_a_step_that_decoded_part_of_the_batch() -> None:
    preempted = [*CHUNKED[:8], {"a": 9, "b": 7, "c": 6}, *CHUNKED[8:]]
    window = steady_window(_steps(preempted), batch=4)
    assert (window.steps, window.tokens) == (3, 12)
    assert window.seconds == 8.0 - 5.0


def test_window_is_refused_when_the_first_request_ends_before_the_last_starts() -> None:
    short = [{"a": 1}, {"a": 2, "b": 1}, {"a": 3, "b": 2, "c": 1}]
    with pytest.raises(ValueError, match="no step decoded the whole batch"):
        steady_window(_steps(short, full=3), batch=3)


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_decode_rate_counts_only_the_steady_window_on_a_tiny_shape(overlap: bool) -> None:
    llm = LLM(
        model="shape:tiny-llama",
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=64,
        num_kv_blocks=32,
        overlap_scheduling=overlap,
    )
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 512, (4, 16), generator=generator).tolist()
    stats = engine_throughput(llm, prompts, 12, Ceilings(1e9, 1e9), Ceilings(2e9, 4e9))
    assert (stats["decode_steps"], stats["decode_tokens"]) == (7, 28)
    assert stats["decode_tokens_before_window"] == 7
    assert stats["decode_tokens_per_s"] == 28 / stats["decode_s"]
    assert stats["decode_mean_context"] == 16 + 11 / 4 + 3
    assert stats["mbu_decode_reference"] == stats["mbu_decode"] / 2
    assert stats["mfu_prefill_reference"] == stats["mfu_prefill"] / 4


def test_a_decode_step_reads_fp8_weights_and_fp8_kv_rows_with_their_scales() -> None:
    """SmolLM2's shape, batch 2 at context 100: bfloat16 weights and cache, then FP8 layer
    weights (one byte a value; the LM head and norms stay bfloat16) and an FP8 cache (one
    byte a value and a 4-byte scale per row: 30 layers x 2 x 3 heads x 68 bytes a token)."""
    cfg = shape_config("smollm2-135m")
    rest = (cfg.hidden_size * cfg.vocab_size + 61 * cfg.hidden_size) * 2
    bf16 = decode_step_bytes(cfg, 2, 2, 100)
    assert bf16 == matmul_params(cfg) * 2 + rest + 200 * 30 * 2 * 3 * 64 * 2
    fp8 = decode_step_bytes(cfg, 2, 2, 100, kv=(1, 4), matmul_element_size=1)
    assert fp8 == matmul_params(cfg) + rest + 200 * 30 * 2 * 3 * 68


def test_reference_ceilings_are_the_h200_bf16_measurements() -> None:
    assert reference_ceilings("NVIDIA H200", torch.bfloat16) == Ceilings(4.24e12, 805e12)
    assert reference_ceilings("NVIDIA H200", torch.float32) is None
    assert reference_ceilings("x86_64 (2 threads)", torch.bfloat16) is None


def test_bench_offline_reports_engine_transformers_and_compiled_peer_in_one_record(
    tmp_path: Path,
) -> None:
    result = tmp_path / "offline.json"
    command = [sys.executable, "-m", "splitserve.cli", "bench", "offline", "--shape"]
    command += ["tiny-llama", "--batch-sizes", "1,4", "--input-len", "16", "--output-len", "8"]
    command += ["--peer", "compiled", "--result-file", str(result)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    record = json.loads(result.read_text())
    assert record["model_id"] == "shape:tiny-llama"
    assert record["config"]["peer"] == ["compiled"]
    assert len(record["git_commit"]) == 40
    assert record["reference_ceilings"] is None
    for row, batch in zip(record["decode"], (1, 4), strict=True):
        assert row["batch"] == batch
        assert (row["splitserve"]["decode_steps"], row["splitserve"]["decode_tokens"]) == (
            7,
            7 * batch,
        )
        assert row["compiled"]["decode_steps"] == 7
        for peer in ("transformers", "compiled"):
            assert row[peer]["decode_tokens_per_s"] > 0
        assert row["speedup_decode_vs_compiled"] == (
            row["splitserve"]["decode_tokens_per_s"] / row["compiled"]["decode_tokens_per_s"]
        )

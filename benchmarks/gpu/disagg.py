"""KV transfer between two GPUs: KVTransport (nccl) next to raw torch.distributed send/recv,
and time to first token of a colocated engine next to a prefill -> decode handoff.

Two processes, one per GPU (rank 0 = prefill / sender on cuda:0, rank 1 = decode / receiver
on cuda:1). Both parts run in the same invocation so that every number has its baseline
beside it. Prints a table and writes JSON to $OUT/disagg.json (or --out).

    python -m benchmarks.gpu.disagg                     # llama3-8b shape, random weights
    python -m benchmarks.gpu.disagg --skip-engines      # transfer bandwidth only
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from splitserve.kvstore.transfer import KVTransport, StoreAddress, start_store

MIB = 1 << 20
SIZES_MIB = (16, 64, 256, 1024)
ITERS = 10
PROMPT_LENS = (512, 2048, 8192)
TTFT_TRIALS = 3
OUTPUT_TOKENS = 8


def main() -> int:
    args = _parse()
    if torch.cuda.device_count() < 2:
        print("gpu_disagg needs two CUDA GPUs", file=sys.stderr)
        return 2
    store, address = start_store("127.0.0.1")
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(args, address, queue), nprocs=2, join=True)
    results: dict[int, dict[str, Any]] = {}
    while not queue.empty():
        rank, result = queue.get()
        results[rank] = result
    del store
    report = _report(args, results)
    _print(report)
    out = Path(args.out or os.environ.get("OUT", ".")) / "disagg.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama3-8b", help="random-weight model shape")
    parser.add_argument("--skip-engines", action="store_true", help="bandwidth only")
    parser.add_argument("--out", default=None, help="result folder (default: $OUT or .)")
    parser.add_argument("--commit", default=None, help="recorded commit (default: git HEAD)")
    return parser.parse_args()


def _worker(rank: int, args: argparse.Namespace, address: StoreAddress, queue: Any) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    store = dist.TCPStore(address.host, address.port, is_master=False)
    dist.init_process_group(
        "cpu:gloo,cuda:nccl",
        store=dist.PrefixStore("raw", store),
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )
    names = ("prefill", "decode")
    transport = KVTransport(names[rank], address, device, "nccl", timeout_s=120)
    result: dict[str, Any] = {"bandwidth": _bandwidth(rank, device, transport)}
    torch.cuda.empty_cache()
    if not args.skip_engines:
        result["ttft"] = _ttft(rank, args.shape, device, transport)
    dist.barrier()
    queue.put((rank, result))
    dist.destroy_process_group()


def _bandwidth(rank: int, device: torch.device, transport: KVTransport) -> list[dict[str, Any]]:
    """GB/s per size through KVTransport and through the default group's send/recv."""
    rows = []
    for size in SIZES_MIB:
        buffer = torch.full((size * MIB // 2,), float(rank), dtype=torch.bfloat16, device=device)
        ways = {
            "kv_transport": lambda b=buffer: _transport_once(rank, transport, b),
            "raw_send_recv": lambda b=buffer: _raw_once(rank, b),
            "raw_send_recv_sync": lambda b=buffer: _raw_once(rank, b, sync=True),
        }
        row: dict[str, Any] = {"mib": size}
        for name, once in ways.items():
            once()  # warm-up (and channel creation)
            torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(ITERS):
                once()
            torch.cuda.synchronize()
            seconds = (time.perf_counter() - start) / ITERS
            row[f"{name}_gbps"] = size * MIB / seconds / 1e9
        if rank == 1:
            row["received_ok"] = bool((buffer == 0).all())
        rows.append(row)
        del buffer
    return rows


def _transport_once(rank: int, transport: KVTransport, buffer: torch.Tensor) -> None:
    if rank == 0:
        transport.send("decode", 0, buffer)
    else:
        transport.recv("prefill", 0, buffer)


def _raw_once(rank: int, buffer: torch.Tensor, sync: bool = False) -> None:
    """One raw send/recv; sync waits for it like a request's transfer does (no pipelining)."""
    if rank == 0:
        dist.send(buffer, dst=1)
    else:
        dist.recv(buffer, src=0)
    if sync:
        torch.cuda.synchronize()


def _ttft(rank: int, shape: str, device: torch.device, transport: KVTransport) -> dict[str, Any]:
    """Rank 0 times colocated TTFT and prefill + send; rank 1 reserves, receives, adopts."""
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model=f"shape:{shape}",
        device=str(device),
        dtype="bfloat16",
        gpu_memory_utilization=0.6,
        max_num_batched_tokens=max(PROMPT_LENS),
        max_model_len=max(PROMPT_LENS) + 64,
        enable_prefix_caching=False,
        seed=0,
    )
    engine = LLMEngine(config)
    _same_random_weights(engine, device)
    vocab = engine.model_config.vocab_size
    out: dict[str, Any] = {"colocated_s": {}, "handoff_s": {}, "equal": {}}
    for length in PROMPT_LENS:
        prompts = [
            torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(t)).tolist()
            for t in range(TTFT_TRIALS + 1)
        ]
        if rank == 0:
            out["colocated_s"][length], colocated = _colocated(engine, prompts)
            out["handoff_start"] = out.get("handoff_start", {})
            out["handoff_start"][length] = _prefill_and_send(engine, transport, prompts)
            out["equal_reference"] = out.get("equal_reference", {})
            out["equal_reference"][length] = colocated
        else:
            for _ in prompts:
                dist.barrier()  # rank 0's colocated trials
            out["handoff_end"] = out.get("handoff_end", {})
            out["handoff_end"][length], out["equal"][length] = _receive(engine, transport, prompts)
    return out


def _same_random_weights(engine: Any, device: torch.device) -> None:
    """Random-shape weights are not seeded; give both GPUs the same ones (Philox on the
    device, same seed, same order), so that the handoff can be compared token for token."""
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in engine.runner.model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)


def _params() -> Any:
    from splitserve.engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)


def _colocated(engine: Any, prompts: list[list[int]]) -> tuple[list[float], list[int]]:
    """Seconds to the first token, per trial (trial 0 is a warm-up), and trial 0's tokens."""
    times: list[float] = []
    tokens: list[int] = []
    for trial, prompt in enumerate(prompts):
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.add_request(f"c{trial}", prompt, _params())
        first = None
        while engine.has_unfinished_requests():
            for output in engine.step():
                if first is None and output.outputs[0].token_ids:
                    first = time.perf_counter() - start
                if output.finished:
                    tokens = tokens or list(output.outputs[0].token_ids)
        times.append(first or 0.0)
    return times[1:], tokens


def _prefill_and_send(engine: Any, transport: KVTransport, prompts: list[list[int]]) -> list:
    starts = []
    for trial, prompt in enumerate(prompts):
        dist.barrier()  # the decode side has reserved its blocks
        torch.cuda.synchronize()
        starts.append(time.monotonic())
        engine.add_request(f"h{trial}", prompt, _params(), prefill_only=True)
        while engine.has_unfinished_requests():
            engine.step()
        handed = engine.handoff.pop_prefilled(f"h{trial}")
        first = torch.tensor([handed.first_token], device=transport.device)
        transport.send("decode", 1, first)
        transport.send("decode", 1, handed.kv)
        torch.cuda.synchronize()
    return starts[1:]


def _receive(
    engine: Any, transport: KVTransport, prompts: list[list[int]]
) -> tuple[list[float], list[int]]:
    """End times of the handoffs (first token adopted on this GPU) and trial 0's tokens."""
    ends: list[float] = []
    tokens: list[int] = []
    for trial, prompt in enumerate(prompts):
        request_id = f"h{trial}"
        assert engine.handoff.reserve(engine.build_request(request_id, prompt, _params()))
        buffer = engine.handoff.receive_buffer(request_id)
        dist.barrier()
        first = torch.empty(1, dtype=torch.int64, device=transport.device)
        transport.recv("prefill", 1, first)
        transport.recv("prefill", 1, buffer)
        output = engine.admit_prefilled(
            *engine.handoff.adopt(request_id, buffer, int(first.item()))
        )
        torch.cuda.synchronize()
        ends.append(time.monotonic())
        while engine.has_unfinished_requests():
            for out in engine.step():
                output = out
        tokens = tokens or list(output.outputs[0].token_ids)
    return ends[1:], tokens


def _report(args: argparse.Namespace, results: dict[int, dict[str, Any]]) -> dict[str, Any]:
    sender, receiver = results[0], results[1]
    bandwidth = [
        {**s, "received_ok": r["received_ok"]}
        for s, r in zip(sender["bandwidth"], receiver["bandwidth"], strict=True)
    ]
    report: dict[str, Any] = {
        "benchmark": "gpu_disagg",
        "commit": args.commit or _commit(),
        "torch": torch.__version__,
        "gpus": [torch.cuda.get_device_name(i) for i in range(2)],
        "iters": ITERS,
        "bandwidth": bandwidth,
    }
    if not args.skip_engines:
        s, r = sender["ttft"], receiver["ttft"]
        report["shape"] = args.shape
        report["ttft"] = [
            {
                "prompt_tokens": n,
                "colocated_ms": 1e3 * _mean(s["colocated_s"][n]),
                "handoff_ms": 1e3
                * _mean([e - b for b, e in zip(s["handoff_start"][n], r["handoff_end"][n])]),
                "greedy_equal": r["equal"][n] == s["equal_reference"][n],
            }
            for n in PROMPT_LENS
        ]
    return report


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _commit() -> str:
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _print(report: dict[str, Any]) -> None:
    print("GB/s per transfer size; raw sync waits for each transfer, as a request's does")
    print(f"{'MiB':>6} {'KVTransport':>12} {'raw sync':>9} {'raw pipelined':>14} {'ok':>4}")
    for row in report["bandwidth"]:
        print(
            f"{row['mib']:>6} {row['kv_transport_gbps']:>12.1f} "
            f"{row['raw_send_recv_sync_gbps']:>9.1f} {row['raw_send_recv_gbps']:>14.1f} "
            f"{row['received_ok']!s:>4}"
        )
    for row in report.get("ttft", []):
        print(
            f"TTFT {row['prompt_tokens']:>5} tokens: colocated {row['colocated_ms']:.1f} ms, "
            f"1P1D handoff {row['handoff_ms']:.1f} ms, greedy equal {row['greedy_equal']}"
        )


if __name__ == "__main__":
    sys.exit(main())

"""An expert-parallel group served on GPUs, against data parallelism on the same GPUs.

Starts `splitserve serve` (configs/gpu-colocated.yaml, one colocated pool) twice on the same
GPUs: once as one group of ``--gpus`` ranks (``expert_parallel``: the experts sharded, each
rank its own requests and KV), once as ``--gpus`` replicas of the whole model; then sends the
same load to each with `splitserve bench serve` (random token prompts, every request at once,
ignore_eos) and writes the JSON results and a summary to --out. The group's ranks exchange
rows over NCCL; its steps run eagerly (no CUDA graphs, no overlapped scheduling: the exchange
reads its row counts on the host), the replicas' with both.

    python3 -m benchmarks.moe.ep_served --model shape:qwen3-30b-a3b --gpus 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.served.process import Server
from splitserve.bench.report import header


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="shape:qwen3-30b-a3b")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-concurrency", type=int, default=128)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = [
        "--config",
        "configs/gpu-colocated.yaml",
        "--set",
        f"model={args.model}",
        "--set",
        "pools.colocated.num_cpus=1",
        *(item for o in args.overrides for item in ("--set", o)),
    ]
    deployments = {
        f"ep{args.gpus}": ["--set", f"pools.colocated.expert_parallel={args.gpus}"],
        f"dp{args.gpus}": ["--set", f"pools.colocated.replicas={args.gpus}"],
    }
    summary: dict[str, Any] = header(vars(args))
    summary["deployments"] = {}
    for name, extra in deployments.items():
        print(f"== {name}", flush=True)
        try:
            with Server([*common, *extra]) as server:
                result = _bench(args, server, out / f"ep-served-{name}.json")
                result["ready_s"] = server.ready_s
        except (RuntimeError, TimeoutError, subprocess.CalledProcessError) as exc:
            result = {"error": str(exc)[-2000:]}
        summary["deployments"][name] = result
        (out / "ep-served.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("| deployment | ready s | output tok/s | mean TTFT ms | mean TPOT ms | failed |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in summary["deployments"].items():
        if "error" in r:
            print(f"| {name} | error: {r['error'][-200:]} |")
            continue
        print(
            f"| {name} | {r['ready_s']:.0f} | {r['output_throughput']:.0f} | "
            f"{r['mean_ttft_ms']:.0f} | {r['mean_tpot_ms']:.1f} | {r['failed']} |"
        )
    return 0 if all("error" not in r for r in summary["deployments"].values()) else 1


def _bench(args: argparse.Namespace, server: Server, path: Path) -> dict[str, Any]:
    command = [
        sys.executable,
        "-m",
        "splitserve.cli",
        "bench",
        "serve",
        "--base-url",
        server.url,
        "--tokenizer",
        args.model,
        "--dataset",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.num_prompts),
        "--max-concurrency",
        str(args.max_concurrency),
        "--ignore-eos",
        "--disable-tqdm",
        "--result-file",
        str(path),
    ]
    subprocess.run(command, check=True)
    result: dict[str, Any] = json.loads(path.read_text())
    return result


if __name__ == "__main__":
    sys.exit(main())

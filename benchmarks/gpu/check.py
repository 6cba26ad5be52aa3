"""GPU correctness check (run on an NVIDIA machine; part of benchmarks/gpu/run.sh).

Tiny random Llama and Qwen2 models saved as safetensors: splitserve on CUDA in float32, with
the torch and the Triton attention backends and with CUDA graphs, must give transformers'
greedy token ids (same near-tie rule as the CPU tests). Prints a table; JSON to $OUT.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.llm import LLM
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.loader import NumericTokenizer
from splitserve.engine.sampling_params import SamplingParams

NEAR_TIE = 1e-3


def tiny_model(family: str, path: Path) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,
    )
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    model.save_pretrained(path, safe_serialization=True)
    return model.to("cuda").eval()


def first_difference_is_near_tie(
    model: Any, prompt: list[int], ours: list[int], ref: list[int]
) -> bool:
    for index, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + ref[:index]], device="cuda")).logits[0, -1]
            top = torch.topk(logits.float(), 2).values
            return float(top[0] - top[1]) < NEAR_TIE
    return len(ours) == len(ref)


def check(family: str, backend: str, graphs: bool, root: Path) -> dict[str, Any]:
    path = root / family
    hf = tiny_model(family, path)
    config = EngineConfig(
        model=str(path),
        device="cuda",
        dtype="float32",
        max_model_len=1024,
        attention_backend=backend,
        cuda_graph_max_batch=16 if graphs else 0,
        num_kv_blocks=512,
    )
    llm = LLM.from_engine(LLMEngine(config, tokenizer=NumericTokenizer(4096)))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (3, 17, 64, 200, 513)]
    outputs = llm.generate(
        prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), use_tqdm=False
    )
    equal, ties = 0, 0
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt], device="cuda"),
                max_new_tokens=40,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        ref_ids = ref[0, len(prompt) :].tolist()
        ours = output.outputs[0].token_ids
        if ours == ref_ids:
            equal += 1
        elif first_difference_is_near_tie(hf, prompt, ours, ref_ids):
            ties += 1
    ok = equal + ties == len(prompts)
    return {
        "family": family,
        "backend": backend,
        "cuda_graphs": graphs,
        "prompts": len(prompts),
        "equal": equal,
        "near_tie": ties,
        "ok": ok,
    }


def check_store(root: Path) -> dict[str, Any]:
    """The asynchronous write-through on CUDA: an engine's blocks reach a host tier (copied on
    a stream of their own), and a second engine loads the prefix from it with equal tokens."""
    from splitserve.kvstore.store import BlockStore, BlockStoreConfig

    path = root / "llama"
    if not path.exists():
        tiny_model("llama", path)
    store = BlockStore(BlockStoreConfig(host_bytes=1 << 30))
    config = EngineConfig(
        model=str(path), device="cuda", dtype="float32", max_model_len=1024, num_kv_blocks=512
    )
    prompt = torch.randint(0, 4096, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    tokens, cached = [], []
    for _ in range(2):
        engine = LLMEngine(config, tokenizer=NumericTokenizer(4096), block_store=store)
        llm = LLM.from_engine(engine)
        tokens.append(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
        assert engine.prefix_cache is not None
        engine.prefix_cache.flush(wait=True)
        cached.append((engine.stats().cached_tokens_by_tier or {}).get("host", 0))
    ok = tokens[0] == tokens[1] and cached == [0, 288] and len(store.host) == 21
    return {"family": "llama", "backend": "store", "cuda_graphs": True, "prompts": 1,
            "equal": int(tokens[0] == tokens[1]), "near_tie": 0, "ok": ok,
            "host_blocks": len(store.host), "cached_host_tokens": cached}  # fmt: skip


def main() -> int:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            rows.append(check_store(Path(tmp)))
        except Exception as exc:
            rows.append({"family": "llama", "backend": "store", "cuda_graphs": True,
                         "ok": False, "error": repr(exc)[:300]})  # fmt: skip
        for family in ("llama", "qwen2"):
            for backend in ("torch", "triton"):
                for graphs in (False, True):
                    try:
                        rows.append(check(family, backend, graphs, Path(tmp)))
                    except Exception as exc:  # a failing configuration is reported, not hidden
                        rows.append(
                            {
                                "family": family,
                                "backend": backend,
                                "cuda_graphs": graphs,
                                "ok": False,
                                "error": repr(exc)[:300],
                            }
                        )
    print(f"{'family':<7}{'backend':<8}{'graphs':<8}{'equal':>6}{'ties':>6}  ok")
    for r in rows:
        print(
            f"{r['family']:<7}{r['backend']:<8}{r['cuda_graphs']!s:<8}{r.get('equal', '-'):>6}"
            f"{r.get('near_tie', '-'):>6}  {r['ok']} {r.get('error', '')}"
        )
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_check.json").write_text(json.dumps(rows, indent=2))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

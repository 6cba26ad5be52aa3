"""The MoE layer on the GPU kernels (router, permutation, grouped GEMMs, combine) against the
same layer on its torch code: bf16, Qwen3-30B-A3B-sized experts (128, top-8, hidden 2048,
expert width 768) at 1, 16 and 64 tokens. Prints one JSON line; exit 1 on a mismatch.

    python3 -m benchmarks.moe.layer_check
"""

from __future__ import annotations

import json
import sys

import torch

from splitserve.engine.layers.moe import SparseMoE
from splitserve.engine.layers.norm import RMSNorm
from splitserve.engine.model_config import MoEConfig
from splitserve.kernels.dispatch import set_kernels_enabled


def main() -> int:
    torch.manual_seed(0)
    config = MoEConfig(num_experts=128, top_k=8, intermediate_size=768, renormalize=True)
    moe = SparseMoE(2048, config).cuda().to(torch.bfloat16)
    norm = RMSNorm(2048, 1e-6).cuda().to(torch.bfloat16)
    errors = {}
    for tokens in (1, 16, 64):
        x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn_like(x)
        with torch.no_grad():
            ours, _ = moe(x, residual, norm)
            set_kernels_enabled(False)
            try:
                reference, _ = moe(x, residual, norm)
            finally:
                set_kernels_enabled(True)
        scale = float(reference.float().abs().max())
        errors[tokens] = float((ours.float() - reference.float()).abs().max()) / scale
    ok = all(err < 2e-2 for err in errors.values())
    print(json.dumps({"check": "moe-layer-kernels", "ok": ok, "max_rel_err": errors}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

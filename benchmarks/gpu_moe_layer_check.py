"""The MoE layer on the GPU kernels (router, permutation, grouped GEMMs, combine) against the same
layer on its torch code, bf16, Qwen3-30B-A3B-sized experts at 1, 16 and 64 tokens."""

import json

import torch

from splitserve.engine.layers.moe import SparseMoE
from splitserve.engine.layers.norm import RMSNorm
from splitserve.engine.model_config import MoEConfig
from splitserve.kernels.dispatch import set_kernels_enabled

torch.manual_seed(0)
moe = (
    SparseMoE(2048, MoEConfig(num_experts=128, top_k=8, intermediate_size=768, renormalize=True))
    .cuda()
    .to(torch.bfloat16)
)
norm = RMSNorm(2048, 1e-6).cuda().to(torch.bfloat16)
res = {}
for t in (1, 16, 64):
    x = torch.randn(t, 2048, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    with torch.no_grad():
        a, _ = moe(x, r, norm)
        set_kernels_enabled(False)
        b, _ = moe(x, r, norm)
        set_kernels_enabled(True)
    res[t] = float((a.float() - b.float()).abs().max() / b.float().abs().max())
print(json.dumps({"moe_layer_kernels_vs_torch_max_rel_err": res}))
assert all(v < 2e-2 for v in res.values())

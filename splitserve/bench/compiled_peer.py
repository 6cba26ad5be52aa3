"""The compiled-PyTorch peer of `splitserve bench offline --peer compiled`: what a user could
run instead of this engine.

``CompiledLlama`` (static KV cache) with its decode step under
``torch.compile(mode="reduce-overhead", fullgraph=True)`` on CUDA, which replays one CUDA graph
per batch shape; on the CPU the same step runs eagerly. Prefill runs eagerly (gpt-fast's
default). Greedy decoding of a static batch: every row decodes every step, with no host sync
between steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from splitserve.bench.compiled_llama import CompiledLlama
from splitserve.engine.loader import is_random_shape, iter_weights, load_model_config, text_weights

WARM_STEPS = 3
"""Decode steps before timing: under reduce-overhead the first call runs the compiled code,
the second records the CUDA graph, the third replays it."""


def decode_step(model: CompiledLlama, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """One greedy decode step: tokens [B, 1] at position ``pos`` [1] -> next tokens [B, 1]."""
    return model(token, pos).argmax(dim=-1, keepdim=True)


class CompiledPeer:
    def __init__(self, model: CompiledLlama, compile: bool) -> None:
        self.model = model
        self.device = model.output.weight.device
        step: Callable[..., torch.Tensor] = decode_step
        if compile:
            step = torch.compile(decode_step, mode="reduce-overhead", fullgraph=True)
        self.step = step

    def reserve(self, batch: int, max_len: int) -> None:
        """Caches for ``batch`` rows of ``max_len`` positions, kept while they are large enough
        (a new shape compiles and captures the step again)."""
        model = self.model
        if model.batch != batch or model.max_len < max_len:
            model.set_cache(batch, max_len)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """Prompts [B, T] from position 0 -> their first generated tokens [B, 1]."""
        self.reserve(tokens.shape[0], tokens.shape[1] + 1)
        pos = torch.arange(tokens.shape[1], device=self.device)
        return self.model(tokens, pos).argmax(dim=-1, keepdim=True)

    @torch.no_grad()
    def decode(self, token: torch.Tensor, start: int, steps: int) -> torch.Tensor:
        """``steps`` greedy tokens after ``token`` [B, 1] at position ``start`` -> [B, steps]."""
        pos = torch.tensor([start], device=self.device)
        out = []
        for _ in range(steps):
            # A graph's output buffer is overwritten by its next replay: keep a copy.
            token = self.step(self.model, token, pos).clone()
            out.append(token)
            pos += 1
        return torch.cat(out, dim=1) if out else token[:, :0]

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        """Greedy continuations of prompts of one length."""
        tokens = torch.tensor(prompts, device=self.device)
        self.reserve(len(prompts), tokens.shape[1] + new_tokens)
        first = self.prefill(tokens)
        rest = self.decode(first, tokens.shape[1], new_tokens - 1)
        out: list[list[int]] = torch.cat([first, rest], dim=1).tolist()
        return out


def load_compiled_peer(
    path: str, device: torch.device, dtype: torch.dtype, seed: int
) -> CompiledPeer:
    """The peer on the engine's weights: a HF directory or GGUF file as the engine reads it, or
    for ``shape:`` random weights drawn after ``torch.manual_seed(seed)``."""
    cfg = load_model_config(path)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        if is_random_shape(path):
            torch.manual_seed(seed)
        with torch.device(device):
            model = CompiledLlama(cfg)
    finally:
        torch.set_default_dtype(previous)
    if not is_random_shape(path):
        model.load_hf_weights(text_weights(iter_weights(path, cfg)))
    return CompiledPeer(model.eval(), compile=device.type == "cuda")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compiled_throughput(
    peer: CompiledPeer, prompts: list[list[int]], output_len: int
) -> dict[str, float]:
    """Prefill of the batch, then ``output_len - 1`` decode steps of the whole batch, timed
    apart after a warm-up that compiles and captures the step for this shape."""
    tokens = torch.tensor(prompts, device=peer.device)
    batch, length = tokens.shape
    peer.reserve(batch, length + output_len)
    peer.decode(peer.prefill(tokens), length, min(WARM_STEPS, output_len - 1))
    _sync(peer.device)
    start = time.perf_counter()
    first = peer.prefill(tokens)
    _sync(peer.device)
    prefilled = time.perf_counter()
    peer.decode(first, length, output_len - 1)
    _sync(peer.device)
    decode_s = max(time.perf_counter() - prefilled, 1e-9)
    prefill_s = prefilled - start
    stats: dict[str, float] = {
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": batch * length / prefill_s,
    }
    if output_len > 1:
        stats |= {
            "decode_steps": output_len - 1,
            "decode_s": decode_s,
            "decode_tokens_per_s": batch * (output_len - 1) / decode_s,
        }
    return stats

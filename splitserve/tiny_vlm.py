"""`splitserve make-tiny-model DIR`: a tiny random LLaVA-style model, made offline.

What tests and `configs/vision-tiny.yaml` serve: a 2-layer CLIP ViT (32 x 32 pixels, 8 x 8
patches: 16 image tokens) and a 2-layer Llama, written as a Hugging Face LLaVA directory
(config, safetensors, tokenizer with a chat template, image processor config). The tokenizer
is SmolLM2's (from the GGUF file of the embedded default model) plus an ``<image>`` token, so
nothing is downloaded. A fixed seed makes the same weights every time.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 32
PATCH_SIZE = 8
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}<image>{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="where to write the model (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")


def run(args: argparse.Namespace) -> int:
    path = make_tiny_vlm(args.directory, args.seed)
    print(f"splitserve: wrote a tiny vision-language model to {path}")
    return 0


def make_tiny_vlm(directory: str | Path, seed: int = 0, tokenizer: Any = None) -> str:
    """Write the model; tokenizer: SmolLM2's, when the caller has it loaded already."""
    from transformers import LlavaForConditionalGeneration

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    processor = _processor(tokenizer)
    config = _config(processor.tokenizer)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    _spread_weights(model, seed)
    model.generation_config.eos_token_id = processor.tokenizer.eos_token_id
    model.generation_config.bos_token_id = processor.tokenizer.bos_token_id
    model.save_pretrained(path, safe_serialization=True)
    processor.save_pretrained(path)
    return str(path)


def _processor(tokenizer: Any) -> Any:
    import copy

    from transformers import CLIPImageProcessorPil, LlavaProcessor

    from splitserve.engine.loader import load_tokenizer, resolve_model

    if tokenizer is None:
        tokenizer = load_tokenizer(resolve_model("smollm2-135m-instruct"))
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = CHAT_TEMPLATE
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token=IMAGE_TOKEN,
        chat_template=CHAT_TEMPLATE,
    )


def _config(tokenizer: Any) -> Any:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        projection_dim=32,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )


@torch.no_grad()
def _spread_weights(model: Any, seed: int) -> None:
    """Wider random matrices in the vision tower and projector than the default init, so
    that an image's pixels visibly change the text that follows it."""
    generator = torch.Generator().manual_seed(seed + 1)
    for name, param in model.named_parameters():
        if param.dim() >= 2 and ("vision_tower" in name or "multi_modal_projector" in name):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)

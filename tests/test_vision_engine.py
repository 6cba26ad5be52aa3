"""The LLaVA-style model in the engine: greedy ids equal transformers on the same tiny model,
image, and text, through chunked prefill and prefix reuse; prefix reuse never crosses images."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.vision.encoder import VisionEncoder
from splitserve.engine.vision.image_inputs import decode_image
from splitserve.kvstore.hashing import ImageSpan, block_hashes
from tests.support.vision import data_url, encoded, hf_messages, image_chat, picture, tiny_vlm

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Any) -> str:
    return tiny_vlm(tmp_path_factory.mktemp("vlm"), smollm2_tokenizer)


@pytest.fixture(scope="module")
def hf(vlm_path: str) -> tuple[Any, Any]:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(vlm_path, dtype=torch.float32)
    return model.eval(), AutoProcessor.from_pretrained(vlm_path)


def _hf_greedy(hf: tuple[Any, Any], messages: list[dict[str, Any]], images: list[Any]) -> Any:
    model, processor = hf
    text = processor.apply_chat_template(hf_messages(messages), add_generation_prompt=True)
    inputs = processor(text=text, images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None
        )
    return inputs["input_ids"][0].tolist(), out[0, inputs["input_ids"].shape[1] :].tolist()


def decoded(seed: int, fmt: str) -> Any:
    """What the server sees of picture(seed) after a round trip through fmt."""
    return decode_image(encoded(picture(seed), fmt))


def test_image_embeddings_equal_transformers(vlm_path: str, hf: tuple[Any, Any]) -> None:
    model, processor = hf
    image = picture(0, (45, 70))
    pixels = processor.image_processor(image, return_tensors="pt")["pixel_values"]
    encoder = VisionEncoder(vlm_path)
    torch.testing.assert_close(encoder.processor([image]), pixels, atol=1e-6, rtol=0)
    with torch.no_grad():
        ref = model.get_image_features(
            pixel_values=pixels, vision_feature_layer=-2, vision_feature_select_strategy="default"
        ).pooler_output[0]
    torch.testing.assert_close(encoder.encode([image])[0], ref, atol=1e-5, rtol=1e-5)


def test_greedy_equals_transformers_through_chunked_prefill(
    vlm_path: str, hf: tuple[Any, Any]
) -> None:
    """13-token chunks over 8-token blocks: every image is split across steps and blocks."""
    llm = LLM(model=vlm_path, block_size=8, max_num_batched_tokens=13)
    one = image_chat(data_url(encoded(picture(1))), "Describe")
    two = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(encoded(picture(2), "JPEG"))}},
                {"type": "text", "text": "and"},
                {"type": "image_url", "image_url": {"url": data_url(encoded(picture(3), "WEBP"))}},
                {"type": "text", "text": "compare them."},
            ],
        }
    ]
    outputs = llm.chat([one, two], GREEDY, use_tqdm=False)
    references = [
        _hf_greedy(hf, one, [decoded(1, "PNG")]),
        _hf_greedy(hf, two, [decoded(2, "JPEG"), decoded(3, "WEBP")]),
    ]
    for output, (prompt_ids, ref) in zip(outputs, references):
        assert output.prompt_token_ids == prompt_ids
        assert output.outputs[0].token_ids == ref


def test_prefix_reuse_shares_blocks_for_the_same_image_only(vlm_path: str) -> None:
    llm = LLM(model=vlm_path, block_size=8)
    same, other = data_url(encoded(picture(4))), data_url(encoded(picture(5)))
    first = llm.chat(image_chat(same), GREEDY, use_tqdm=False)[0]
    again = llm.chat(image_chat(same), GREEDY, use_tqdm=False)[0]
    changed = llm.chat(image_chat(other), GREEDY, use_tqdm=False)[0]
    image_offset = first.prompt_token_ids.index(llm.vision.config.image_token_id)  # type: ignore[union-attr]
    usable = (len(first.prompt_token_ids) - 1) // 8 * 8
    assert again.num_cached_tokens == usable
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert changed.num_cached_tokens == image_offset // 8 * 8
    assert changed.outputs[0].token_ids != first.outputs[0].token_ids


def test_block_hashes_cover_image_content() -> None:
    tokens = [7] * 4 + [99] * 16 + [8] * 12
    a, b = ImageSpan("a" * 32, 4, 16), ImageSpan("b" * 32, 4, 16)
    text_only, with_a, with_b = (block_hashes(tokens, 8, 0, images=s) for s in ([], [a], [b]))
    assert with_a == block_hashes(tokens, 8, 0, images=[a])
    assert with_a[0] != with_b[0] and with_a[0] != text_only[0]
    assert all(x != y for x, y in zip(with_a, with_b))
    before = block_hashes([7] * 8, 8, 0, images=[ImageSpan("a" * 32, 8, 16)])
    assert before == block_hashes([7] * 8, 8, 0)


def test_decode_engine_recomputes_an_adopted_image_prompt_after_preemption(
    vlm_path: str,
) -> None:
    """The handoff carries the image embeddings with the KV, so a decode engine that must
    recompute the prompt (preempted, no prefix cache) still continues it exactly."""
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.llm_engine import LLMEngine
    from splitserve.engine.vision.chat_images import split_images
    from splitserve.engine.vision.multimodal import ImageInput

    llm = LLM(model=vlm_path, block_size=8)
    messages = image_chat(data_url(encoded(picture(6))))
    expected = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    rendered, pictures = split_images(messages)
    prompt, images = llm._with_images(llm.apply_chat_template(rendered), pictures)
    prefill = LLMEngine(EngineConfig(model=vlm_path, block_size=8), tokenizer=llm.tokenizer)
    prefill.add_request("r", prompt, GREEDY, prefill_only=True, images=images)
    while not prefill.step():
        pass
    handed = prefill.handoff.pop_prefilled("r")
    assert handed.image_embeddings is not None
    decode = LLMEngine(
        EngineConfig(model=vlm_path, block_size=8, enable_prefix_caching=False),
        tokenizer=llm.tokenizer,
    )
    spans = [ImageInput(image.span) for image in images]
    assert decode.handoff.reserve(decode.build_request("r", prompt, GREEDY, spans))
    adopted = decode.handoff.adopt(
        "r", handed.kv, handed.first_token, None, handed.image_embeddings
    )
    decode.admit_prefilled(*adopted)
    decode.step()
    req = decode.scheduler.running.pop()
    decode.scheduler._preempt(req)
    outputs = []
    while decode.has_unfinished_requests():
        outputs += decode.step()
    assert decode.scheduler.num_preemptions == 1
    assert outputs[-1].outputs[0].token_ids == expected.outputs[0].token_ids

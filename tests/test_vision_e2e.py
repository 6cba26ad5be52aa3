"""Images through a real `splitserve serve --config configs/vision-tiny.yaml` (two vision
workers, one prefill, one decode) with the official openai client: greedy output equals
transformers, requests spread over both vision workers, a repeated image hits the encoder
cache, and every bad image gets a 400 while the next good request succeeds."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from splitserve.engine.vision.image_inputs import decode_image
from tests.support.server_process import ServerProcess, serve, worker_metric
from tests.support.vision import data_url, encoded, hf_messages, image_chat, picture, tiny_vlm
from tests.support.wait import wait_for

pytestmark = pytest.mark.slow
MAX_TOKENS = 8
ENCODED = "splitserve:images_encoded_total"
HITS = "splitserve:encoder_cache_hits_total"
VISION = ("vision-0", "vision-1")
LIMITS = (
    "images.max_pixels=20000",
    "images.max_bytes=100000",
    "images.max_per_request=2",
)


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Any) -> str:
    return tiny_vlm(tmp_path_factory.mktemp("vlm"), smollm2_tokenizer)


class ImagesSent:
    """Images of the requests the server answered, counted by the tests that sent them. Each
    is either encoded or taken from an encoder cache, so the vision workers' stats (sent every
    0.2 s) have caught up once encoded plus cache hits reach this count."""

    count = 0


@pytest.fixture(scope="module")
def server(vlm_path: str) -> Iterator[ServerProcess]:
    overrides = (f"model={vlm_path}", "pools.vision.replicas=2", *LIMITS)
    with serve(*overrides, config="configs/vision-tiny.yaml") as process:
        ImagesSent.count = 0
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0)


def _chat(client: openai.OpenAI, model: str, messages: list[dict[str, Any]]) -> str:
    reply = client.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    ImagesSent.count += sum(
        part["type"] == "image_url"
        for m in messages
        for part in m["content"]
        if isinstance(part, dict)
    )
    return reply.choices[0].message.content or ""


def _hf_text(path: str, messages: list[dict[str, Any]], images: list[Any]) -> str:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(path)
    text = processor.apply_chat_template(hf_messages(messages), add_generation_prompt=True)
    inputs = processor(text=text, images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None
        )
    ids = out[0, inputs["input_ids"].shape[1] :].tolist()
    return str(processor.tokenizer.decode(ids, skip_special_tokens=True))


def _settled(server: ServerProcess, name: str) -> dict[str, float]:
    """Per vision worker, once their stats count every image sent before."""

    def counted() -> float:
        return _metric_total(server, ENCODED) + _metric_total(server, HITS)

    wait_for(
        lambda: counted() >= ImagesSent.count,
        10,
        message=lambda: (
            f"{ImagesSent.count} images sent counted by the vision workers' "
            f"stats (encoded + cache hits: {counted():g})"
        ),
    )
    return {w: worker_metric(server.url, name, w) for w in VISION}


def _metric_total(server: ServerProcess, name: str) -> float:
    return sum(worker_metric(server.url, name, w) for w in VISION)


def _total_reaching(server: ServerProcess, name: str, at_least: float) -> float:
    """The metric's total once the workers' stats show at least ``at_least``."""
    wait_for(
        lambda: _metric_total(server, name) >= at_least,
        10,
        interval=0.1,
        message=lambda: (
            f"{name} of {VISION} reaching {at_least:g} (now {_metric_total(server, name):g})"
        ),
    )
    return _metric_total(server, name)


def test_greedy_vision_prefill_decode_equals_transformers(
    server: ServerProcess, client: openai.OpenAI, vlm_path: str
) -> None:
    png, jpeg = encoded(picture(10)), encoded(picture(11), "JPEG")
    messages = image_chat(data_url(png), "Describe")
    two = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(jpeg, "image/jpeg")}},
                {"type": "text", "text": "versus"},
                {"type": "image_url", "image_url": {"url": data_url(png)}},
            ],
        }
    ]
    ours = [_chat(client, vlm_path, messages), _chat(client, vlm_path, two)]
    expected = [
        _hf_text(vlm_path, messages, [decode_image(png)]),
        _hf_text(vlm_path, two, [decode_image(jpeg), decode_image(png)]),
    ]
    assert ours == expected
    assert ours[0] != _chat(
        client, vlm_path, image_chat(data_url(encoded(picture(12))), "Describe")
    )


def test_concurrent_image_requests_use_both_vision_workers(
    server: ServerProcess, vlm_path: str
) -> None:
    before = _settled(server, ENCODED)
    client = openai.AsyncOpenAI(base_url=server.api, api_key="unused", max_retries=0)

    async def one(seed: int) -> str:
        reply = await client.chat.completions.create(
            model=vlm_path,
            messages=image_chat(data_url(encoded(picture(100 + seed)))),  # type: ignore[arg-type]
            max_tokens=4,
            temperature=0,
        )
        ImagesSent.count += 1
        return reply.choices[0].message.content or ""

    async def run_all() -> list[str]:
        return list(await asyncio.gather(*(one(s) for s in range(6))))

    assert all(asyncio.run(run_all()))
    _total_reaching(server, ENCODED, sum(before.values()) + 6)
    gained = {w: worker_metric(server.url, ENCODED, w) - before[w] for w in VISION}
    assert sum(gained.values()) == 6
    assert min(gained.values()) >= 1, gained


def test_repeated_image_is_encoded_once_and_then_hits_the_encoder_cache(
    server: ServerProcess, client: openai.OpenAI, vlm_path: str
) -> None:
    messages = image_chat(data_url(encoded(picture(200))))
    encoded_before = sum(_settled(server, ENCODED).values())
    hits_before = _metric_total(server, HITS)
    first = _chat(client, vlm_path, messages)
    assert _total_reaching(server, ENCODED, encoded_before + 1) == encoded_before + 1
    assert _chat(client, vlm_path, messages) == first
    assert _total_reaching(server, HITS, hits_before + 1) == hits_before + 1
    assert _metric_total(server, ENCODED) == encoded_before + 1


def _gif() -> str:
    return data_url(encoded(picture(1), "GIF"), "image/gif")


BAD_IMAGES: dict[str, tuple[Any, str]] = {
    "bad_base64": (lambda: "data:image/png;base64,not*base64!", "invalid_base64"),
    "undecodable": (lambda: data_url(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64), "invalid_image"),
    "gif": (_gif, "unsupported_format"),
    "bmp_as_png": (lambda: data_url(encoded(picture(1), "BMP")), "unsupported_format"),
    "too_many_pixels": (lambda: data_url(encoded(picture(2, (150, 150)))), "image_too_large"),
    "too_many_bytes": (lambda: data_url(encoded(picture(3, (200, 200)))), "image_too_large"),
    "remote_url": (lambda: "http://169.254.169.254/latest/image.png", "image_url_not_allowed"),
}


@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
def test_bad_image_gets_400_and_the_next_good_request_succeeds(
    server: ServerProcess, client: openai.OpenAI, vlm_path: str, case: str
) -> None:
    make_url, code = BAD_IMAGES[case]
    with pytest.raises(openai.BadRequestError) as error:
        _chat(client, vlm_path, image_chat(make_url()))
    assert error.value.status_code == 400
    body = error.value.body
    assert isinstance(body, dict)
    assert body["type"] == "invalid_request_error"
    assert (body["param"], body["code"]) == ("messages", code)
    assert _chat(client, vlm_path, image_chat(data_url(encoded(picture(300)))))


def test_too_many_images_get_400_and_the_next_good_request_succeeds(
    server: ServerProcess, client: openai.OpenAI, vlm_path: str
) -> None:
    part = {"type": "image_url", "image_url": {"url": data_url(encoded(picture(4)))}}
    messages = [{"role": "user", "content": [part, part, part]}]
    with pytest.raises(openai.BadRequestError) as error:
        _chat(client, vlm_path, messages)
    body = error.value.body
    assert isinstance(body, dict) and body["code"] == "too_many_images"
    assert _chat(client, vlm_path, image_chat(data_url(encoded(picture(301)))))
    assert httpx.get(f"{server.url}/health").json()["pools"]["vision"]["ready"] == 2


def test_scale_vision_pool_down_drains_and_images_still_work(
    server: ServerProcess, client: openai.OpenAI, vlm_path: str
) -> None:
    command = [sys.executable, "-m", "splitserve.cli", "scale", "--base-url", server.url]
    out = subprocess.run(
        [*command, "--vision", "1"], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert 'vision (vision): 1 ["vision-0"]' in out
    before = _settled(server, ENCODED)
    assert _chat(client, vlm_path, image_chat(data_url(encoded(picture(400)))))
    assert _total_reaching(server, ENCODED, sum(before.values()) + 1) == sum(before.values()) + 1
    assert worker_metric(server.url, ENCODED, "vision-0") == before["vision-0"] + 1
    assert httpx.get(f"{server.url}/health").json()["pools"]["vision"]["replicas"] == 1

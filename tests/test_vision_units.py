"""The vision service's parts without processes: the encoder cache, the vision router, the
messages that carry images, a vision worker that meets an image it cannot decode, and image
URLs fetched only from allowed hosts."""

from __future__ import annotations

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from splitserve.config import ImagesConfig
from splitserve.engine.config import EngineConfig
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.vision.image_inputs import ImageError
from splitserve.kvstore.hashing import ImageSpan
from splitserve.router.policy import Candidate
from splitserve.router.vision import VisionRouter
from splitserve.services import messages as msg
from splitserve.services.api.images import fetch
from splitserve.services.workers.encoder_cache import EncoderCache
from splitserve.services.workers.spec import WorkerSpec
from splitserve.services.workers.vision import VisionWorker
from tests.support.vision import encoded, picture


def test_encoder_cache_evicts_least_recently_used_by_bytes() -> None:
    cache = EncoderCache(capacity_bytes=3 * 64)
    for name in "abc":
        cache.put(name, torch.zeros(16))  # 64 bytes each
    assert cache.get("a") is not None
    cache.put("d", torch.zeros(16))
    assert [cache.get(n) is not None for n in "abcd"] == [True, False, True, True]
    cache.put("huge", torch.zeros(1000))
    assert cache.get("huge") is None and cache.used_bytes == 3 * 64


def test_vision_router_spreads_by_load_and_sends_repeats_back() -> None:
    router = VisionRouter()
    idle = [Candidate("vision-0"), Candidate("vision-1")]
    assert router.choose(idle, ["x"]) == 0
    busy_first = [Candidate("vision-0", inflight=1), Candidate("vision-1")]
    assert router.choose(busy_first, ["y"]) == 1
    assert router.choose(idle, ["y"]) == 1  # y was encoded on vision-1
    assert router.choose(busy_first, ["x"]) == 1  # load wins over the cache
    unhealthy = [Candidate("vision-0", healthy=False), Candidate("vision-1", inflight=5)]
    assert router.choose(unhealthy, ["z"]) == 1


def test_image_messages_round_trip_with_bytes_and_spans() -> None:
    encode = msg.EncodeImages("r1", [msg.ImageData("ab" * 16, b"\x89PNG")], "prefill-0", "tcp://x")
    assert msg.decode(msg.encode(encode)) == encode
    span = ImageSpan("ab" * 16, 3, 16)
    reserve = msg.Reserve("r1", [1, 2], SamplingParams(), "prefill-0", [span])
    assert msg.decode(msg.encode(reserve)) == reserve


def test_vision_worker_answers_an_undecodable_image_with_a_400_and_keeps_going() -> None:
    worker = VisionWorker(WorkerSpec("vision-0", "vision", EngineConfig("unused")))
    for data in (b"not an image", b"GIF89a" + b"\x00" * 32, b""):
        worker._run(msg.EncodeImages("r", [msg.ImageData("h", data)], "prefill-0", "tcp://x"))
    assert [(e.request_id, e.status) for e in worker._errors] == [("r", 400)] * 3
    assert worker.images_encoded == 0 and len(worker.cache) == 0


def test_image_urls_are_fetched_only_from_allowed_hosts_without_redirects() -> None:
    png = encoded(picture(0))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/moved.png":
                self.send_response(302)
                self.send_header("Location", "http://169.254.169.254/")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(png)))
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        allowed = ImagesConfig(allowed_hosts=("127.0.0.1",))
        assert asyncio.run(fetch(f"{base}/cat.png", allowed)) == png
        for url, limits, code in [
            (f"{base}/cat.png", ImagesConfig(), "image_url_not_allowed"),
            (f"{base}/moved.png", allowed, "image_fetch_failed"),
            (
                f"{base}/cat.png",
                ImagesConfig(allowed_hosts=("127.0.0.1",), max_bytes=100),
                "image_too_large",
            ),
            ("ftp://127.0.0.1/cat.png", allowed, "invalid_url"),
        ]:
            with pytest.raises(ImageError) as error:
                asyncio.run(fetch(url, limits))
            assert error.value.code == code
    finally:
        server.shutdown()

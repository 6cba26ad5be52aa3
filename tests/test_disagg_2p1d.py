"""Two prefill workers + one decode worker: still colocated outputs, both prefill workers used."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from splitserve.engine.llm import LLM
from tests.disagg import PROMPTS, completions, reference
from tests.server_process import ServerProcess, serve, worker_metric

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with serve("pools.prefill.replicas=2") as process:
        yield process


@pytest.mark.parametrize("stream", [False, True], ids=["full", "streamed"])
def test_30_prompts_through_2_prefill_workers_equal_colocated(
    server: ServerProcess, smollm2_llm: LLM, stream: bool
) -> None:
    assert completions(server.url, PROMPTS, stream) == reference(smollm2_llm, PROMPTS)


def test_round_robin_sent_kv_from_both_prefill_workers(server: ServerProcess) -> None:
    completions(server.url, PROMPTS[:4], stream=False)
    sent = [worker_metric(server.url, BYTES, w) for w in ("prefill-0", "prefill-1")]
    assert min(sent) > 0
    assert worker_metric(server.url, BYTES, "decode-0") == sum(sent)


BYTES = "splitserve:kv_transfer_bytes_total"

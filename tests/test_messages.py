"""Typed messages survive msgpack round trips; anything else is refused, nothing is unpickled."""

from __future__ import annotations

import pickle
import subprocess
import sys

import msgpack
import pytest

from splitserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from splitserve.services import messages as msg


def test_generate_request_round_trips_with_sampling_params() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=7, stop=["\n"], seed=3, logprobs=2)
    message = msg.GenerateRequest("r-1", [1, 2, 3], params)
    decoded = msg.decode(msg.encode(message))
    assert decoded == message
    assert isinstance(decoded, msg.GenerateRequest)
    assert isinstance(decoded.params, SamplingParams)


STRUCTURED = [
    StructuredOutputsParams(
        json={
            "type": "object",
            "properties": {"a": {"type": "array", "items": {"enum": [1, 2.5, None, True]}}},
            "required": ["a"],
        }
    ),
    StructuredOutputsParams(json='{"type": "integer", "minimum": 3}'),
    StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(regex=r"\d{3}-[a-z]+"),
    StructuredOutputsParams(choice=["yes", "no", "é"]),
    StructuredOutputsParams(grammar='root ::= "a" | "b"'),
]


@pytest.mark.parametrize("spec", STRUCTURED, ids=[s.kind for s in STRUCTURED])
def test_structured_outputs_round_trip_in_every_request_message(
    spec: StructuredOutputsParams,
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5, structured_outputs=spec)
    for message in (
        msg.GenerateRequest("r", [1, 2], params),
        msg.Reserve("r", [1, 2], params, "prefill-0"),
        msg.Prefill("r", [1, 2], params, "decode-0", "tcp://127.0.0.1:5555"),
    ):
        decoded = msg.decode(msg.encode(message))
        assert decoded == message
        assert isinstance(decoded.params.structured_outputs, StructuredOutputsParams)  # type: ignore[union-attr]


def test_structured_outputs_of_two_kinds_are_refused_on_decode() -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    raw = msgpack.unpackb(msg.encode(msg.GenerateRequest("r", [1], params)))
    raw[1][2][-1][3] = 'root ::= "a"'  # grammar beside the regex
    with pytest.raises(ValueError, match="exactly one"):
        msg.decode(msgpack.packb(raw))


def test_output_batch_round_trips_nested_deltas_and_errors() -> None:
    delta = msg.TokenDelta(
        request_id="r-1",
        text="é🎉",
        token_ids=[5, 6],
        logprobs=[[msg.TokenLogprob(5, -0.5, 1, "é")], [msg.TokenLogprob(6, -1.0, 2, None)]],
        finish_reason="stop",
        stop_reason="\n",
        num_prompt_tokens=4,
        num_cached_tokens=0,
    )
    batch = msg.OutputBatch([delta], [msg.RequestError("r-2", "too long")])
    assert msg.decode(msg.encode(batch)) == batch


def test_stats_and_abort_round_trip() -> None:
    stats = msg.WorkerStats(
        worker_id="w-0",
        num_running=1,
        num_waiting=2,
        num_free_blocks=3,
        num_total_blocks=4,
        kv_usage=0.25,
        prompt_tokens_computed=10,
        prompt_tokens_cached=5,
    )
    abort = msg.AbortRequest(["a", "b"])
    assert msg.decode(msg.encode(stats)) == stats
    assert msg.decode(msg.encode(abort)) == abort


def test_disaggregation_messages_round_trip() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4)
    logprobs = [msg.TokenLogprob(7, -0.1, 1, "a"), msg.TokenLogprob(8, -2.5, 2, None)]
    messages = [
        msg.Reserve("r", [1, 2], params, "prefill-0"),
        msg.Reserved("r"),
        msg.Prefill("r", [1, 2], params, "decode-0", "tcp://127.0.0.1:5555"),
        msg.KvHeader("r", "prefill-0", 3, 7, logprobs, [2, 30, 1, 16, 3, 64], "float32"),
        msg.KvHeader("r", "prefill-0", 0, 7, None, [2, 1, 1, 16, 1, 8], "bfloat16"),
        msg.WorkerStats(worker_id="w", kv_transfer_bytes=737280, kv_transfer_seconds=[0.001, 0.25]),
        msg.OutputBatch([], [msg.RequestError("r", "transfer failed", 503)]),
        msg.Prefill("r", [1], params, "d", "tcp://a:1", None, [], msg.PeerPrefix("p", "x", 3)),
        msg.FetchBlocks("r", "prefill-1", "tcp://127.0.0.1:5556", [2**64 - 1, 0, 12345]),
        msg.PeerBlocks("r", "prefill-0", 2, 3, [2, 30, 3, 16, 3, 64], "float32"),
        msg.PeerBlocks("r", "prefill-0", 0, 0, [], ""),
    ]
    for message in messages:
        assert msg.decode(msg.encode(message)) == message


def test_wire_format_is_type_name_and_field_values() -> None:
    raw = msgpack.unpackb(msg.encode(msg.AbortRequest(["a"])))
    assert raw == ["AbortRequest", [["a"]]]


def _stats_with_a_string_count() -> bytes:
    name, body = msgpack.unpackb(msg.encode(msg.WorkerStats(worker_id="w")))
    body[0] = "1"  # num_running
    return msgpack.packb([name, body])


@pytest.mark.parametrize(
    "data",
    [
        pickle.dumps(msg.AbortRequest(["a"])),
        msgpack.packb(["Exploit", []]),
        msgpack.packb(["AbortRequest", []]),
        msgpack.packb(["AbortRequest", ["not a list"]]),
        _stats_with_a_string_count(),
        b"\xc1",
    ],
)
def test_anything_but_a_registered_message_is_refused(data: bytes) -> None:
    with pytest.raises(ValueError, match="malformed message"):
        msg.decode(data)


def test_invalid_sampling_params_are_refused_on_decode() -> None:
    raw = msgpack.unpackb(msg.encode(msg.GenerateRequest("r", [1], SamplingParams())))
    raw[1][2][1] = 5.0  # temperature
    with pytest.raises(ValueError):
        msg.decode(msgpack.packb(raw))


def test_only_message_types_can_be_encoded() -> None:
    with pytest.raises(TypeError):
        msg.encode(SamplingParams())  # type: ignore[arg-type]


def test_messages_protocol_and_sampling_params_import_without_torch() -> None:
    code = (
        "import sys\n"
        "import splitserve.services.messages, splitserve.services.api.protocol\n"
        "from splitserve import SamplingParams\n"
        "assert SamplingParams(seed=1).seed == 1\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout == "[]\n"

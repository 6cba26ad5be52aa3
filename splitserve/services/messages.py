"""Typed messages between the API server and the workers, msgpack over ZMQ.

Every message is a dataclass; on the wire it is ``[type name, [field values...]]``, nested
dataclasses as value lists too. Decoding accepts only the types registered here, so a socket
never deserialises anything but plain msgpack values (no pickle, no arbitrary classes).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

import msgpack

from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.stats import COUNTER, GAUGE, HISTOGRAM, VISION, EngineStats, stat
from splitserve.kvstore.hashing import ImageSpan
from splitserve.services import wire


@dataclass(frozen=True)
class GenerateRequest:
    """API server -> worker: start generating for an already tokenized prompt."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    traffic_class: str | None = None
    resumed: int = 0
    """The prompt's last tokens that are output of an earlier run (a migrated request)."""
    resumed_chars: int = 0
    """Of those tokens' text, the characters the client already has (engine/resume.py)."""


@dataclass(frozen=True)
class Reserve:
    """API server -> decode worker: reserve KV blocks for a prompt that prefill_worker computes."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prefill_worker: str
    images: list[ImageSpan] = dataclasses.field(default_factory=list)
    """The prompt's images: their content hashes keep the block hashes image-aware."""
    resumed: int = 0
    """The prompt's last tokens that are output of an earlier run (a migrated request)."""
    resumed_chars: int = 0
    """Of those tokens' text, the characters the client already has (engine/resume.py)."""


@dataclass(frozen=True)
class Reserved:
    """Decode worker -> API server: blocks are reserved, the prefill may start."""

    request_id: str


@dataclass(frozen=True)
class PeerPrefix:
    """Another prefill worker that holds more of a prompt's leading blocks (by the prefix
    index, so possibly stale): the first ``blocks`` of them, asked for on its request socket."""

    worker_id: str
    request_addr: str
    blocks: int


@dataclass(frozen=True)
class Prefill:
    """API server -> prefill worker: compute the prompt and send its KV to decode_worker."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    decode_worker: str
    decode_kv_addr: str
    traffic_class: str | None = None
    images: list[ImageSpan] = dataclasses.field(default_factory=list)
    """The prompt's images; their embeddings come from a vision worker (EmbeddingsHeader)."""
    peer: PeerPrefix | None = None
    """Pull the prompt's prefix from this worker before computing the rest (peer_blocks.py)."""
    resumed: int = 0
    """The prompt's last tokens that are output of an earlier run (a migrated request)."""


@dataclass(frozen=True)
class FetchBlocks:
    """Prefill worker -> peer prefill worker: send the leading blocks of ``block_hashes``
    that you hold (device cache or block store), announced by a PeerBlocks to reply_addr."""

    request_id: str
    requester: str
    reply_addr: str
    block_hashes: list[int]


@dataclass(frozen=True)
class PeerBlocks:
    """Peer -> requester: ``blocks`` leading blocks of a FetchBlocks follow on channel
    generation as one tensor [parts, layers, blocks, block_size, heads, head_dim] (nothing
    follows when blocks is 0)."""

    request_id: str
    sender: str
    generation: int
    blocks: int
    shape: list[int]
    dtype: str


@dataclass(frozen=True)
class ImageData:
    """One image's file bytes (already checked by the API server) and content hash."""

    image_hash: str
    data: bytes


@dataclass(frozen=True)
class EncodeImages:
    """API server -> vision worker: encode these images (cached ones are not encoded again)
    and send their embeddings, in order, to prefill_worker's embeddings socket."""

    request_id: str
    images: list[ImageData]
    prefill_worker: str
    prefill_addr: str


@dataclass(frozen=True)
class EmbeddingsHeader:
    """Vision worker -> prefill worker: the embeddings of request_id's images follow on
    channel generation, one [tokens, hidden] tensor of all images in prompt order."""

    request_id: str
    sender: str
    generation: int
    shape: list[int]
    dtype: str


@dataclass(frozen=True)
class KvHeader:
    """Prefill worker -> decode worker: the KV of request_id follows on channel generation.

    logprobs: the first token's (token id, logprob, rank, decoded) entries, or None.
    """

    request_id: str
    sender: str
    generation: int
    first_token: int
    logprobs: list[TokenLogprob] | None
    shape: list[int]
    dtype: str
    embeddings_shape: list[int] | None = None
    """Image prompts: the shape of the images' embeddings, sent (same dtype) after the KV."""


@dataclass(frozen=True)
class AbortRequest:
    """API server -> worker: stop these requests and free their KV blocks."""

    request_ids: list[str]


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int
    decoded_token: str | None


@dataclass(frozen=True)
class TokenDelta:
    """What one request gained since its previous delta.

    logprobs[i] belongs to token_ids[i]: the sampled token first, then the top alternatives.
    """

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[list[TokenLogprob]] | None
    finish_reason: str | None
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_cached_tokens: int


@dataclass(frozen=True)
class RequestError:
    """Worker -> API server: a request failed.

    status 400: the engine rejected it (for example, too long); 503: the service failed it
    (a KV transfer that broke or timed out, a worker that stopped).
    """

    request_id: str
    message: str
    status: int = 400


@dataclass(frozen=True)
class OutputBatch:
    """Worker -> API server: everything one engine step produced, and errors since the last."""

    deltas: list[TokenDelta]
    errors: list[RequestError]


@dataclass(frozen=True)
class PhaseSeconds:
    """Seconds a worker's loop spent in one phase since start (engine/phases.py)."""

    phase: str
    seconds: float


TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


@dataclass(frozen=True)
class WorkerStats(EngineStats):
    """Worker -> API server, a few times a second: load and KV occupancy (also a heartbeat).

    Its engine's statistics (engine/stats.py: ``EngineStats``, all zero for a vision worker)
    and the worker's own, declared below the same way: each field's ``stat`` gives its help
    text and metric, from which services/metrics.py derives the series."""

    worker_id: str = ""
    kv_transfer_bytes: int = stat("KV bytes a worker sent (prefill) or received (decode)", COUNTER)
    kv_transfer_seconds: list[float] = stat(
        "Duration of one request's KV transfer", HISTOGRAM, [], buckets=TRANSFER_BUCKETS
    )
    prefill_tokens_per_s: float = stat("Recent prompt throughput (0 until measured)", None, 0.0)
    node_id: str = stat("Holder id of the node's shared block store tier (none: '')", None, "")
    images_encoded: int = stat(
        "Images a vision worker ran its encoder on", COUNTER, sparse=True, source=VISION
    )
    encoder_cache_hits: int = stat(
        "Images a vision worker took from its encoder cache", COUNTER, sparse=True, source=VISION
    )
    encode_seconds: list[float] = stat(
        "Duration of one vision encoder run",
        HISTOGRAM,
        [],
        metric="image_encode_seconds",
        buckets=TRANSFER_BUCKETS,
        source=VISION,
    )
    loop_phases: list[PhaseSeconds] = stat(
        "Seconds of a worker's loop by phase (engine: schedule, forward, wait, outputs; "
        "worker: idle, receive, reserve, adopt, handoff, worker, send, stats)",
        COUNTER,
        [],
        metric="worker_loop_seconds",
        label="phase",
    )
    loop_steps: int = stat("Engine steps a worker took", COUNTER, metric="worker_loop_steps")
    hash_root: int = stat(
        "The start of the worker's block hash chains (kvstore/hashing.py; 0: a vision worker)"
    )
    eplb_rebalances: int = stat(
        "Expert rebalances of the rank's expert-parallel group", COUNTER, sparse=True
    )
    eplb_imbalance: float = stat(
        "Rank load max/mean of the group's last EPLB interval, before its rebalance",
        GAUGE,
        0.0,
        sparse=True,
    )


@dataclass(frozen=True)
class IndexUpdate:
    """Worker -> API server, for an index in the API server's memory (prefix_index memory://):
    ``holder`` now has ``stored`` and no longer ``evicted`` in ``tier``; with ``rebuild``,
    ``stored`` replaces everything the holder had there."""

    holder: str
    tier: str
    stored: list[int]
    evicted: list[int]
    rebuild: bool = False


@dataclass(frozen=True)
class WorkerFailed:
    """Worker -> API server: the worker's loop stopped on an unexpected error. Every request
    it holds has failed; the API server stops routing to it and fails what waits on it."""

    worker_id: str
    reason: str


@dataclass(frozen=True)
class Heartbeat:
    """Worker -> API server, from a thread of its own (not the loop) every second: the worker
    is alive even while its loop is inside a step longer than the heartbeat timeout.
    loop_busy_s: how long the loop's current round has been running."""

    worker_id: str
    loop_busy_s: float


Message = (
    GenerateRequest
    | Reserve
    | Reserved
    | Prefill
    | FetchBlocks
    | PeerBlocks
    | EncodeImages
    | EmbeddingsHeader
    | KvHeader
    | AbortRequest
    | OutputBatch
    | WorkerStats
    | IndexUpdate
    | WorkerFailed
    | Heartbeat
)
_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        GenerateRequest,
        Reserve,
        Reserved,
        Prefill,
        FetchBlocks,
        PeerBlocks,
        EncodeImages,
        EmbeddingsHeader,
        KvHeader,
        AbortRequest,
        OutputBatch,
        WorkerStats,
        IndexUpdate,
        WorkerFailed,
        Heartbeat,
    )
}


def encode(message: Message) -> bytes:
    """Serialise a registered message to msgpack bytes."""
    name = type(message).__name__
    if name not in _TYPES:
        raise TypeError(f"{name} is not a message type")
    return msgpack.packb([name, wire.encoder(_TYPES[name])(message)], use_bin_type=True)


def decode(data: bytes) -> Message:
    """Parse bytes produced by ``encode``; ValueError on anything else."""
    try:
        name, body = msgpack.unpackb(data, raw=False, strict_map_key=True)
        cls = _TYPES[name]
        return typing.cast(Message, wire.decoder(cls)(body))
    except (ValueError, TypeError, KeyError, msgpack.ExtraData) as exc:
        raise ValueError(f"malformed message: {exc}") from exc

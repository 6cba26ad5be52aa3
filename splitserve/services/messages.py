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
    generation as one tensor [2, layers, blocks, block_size, kv_heads, head_dim] (nothing
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


@dataclass(frozen=True)
class WorkerStats:
    """Worker -> API server, a few times a second: load and KV occupancy (also a heartbeat).

    kv_transfer_bytes counts KV sent plus received since start; kv_transfer_seconds lists the
    durations of the transfers finished since the previous stats message.
    """

    worker_id: str
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_usage: float
    prompt_tokens_computed: int
    prompt_tokens_cached: int
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: list[float] = dataclasses.field(default_factory=list)
    cached_host_tokens: int = 0
    """Of prompt_tokens_cached, the tokens loaded from the host tier (the rest: disk, device)."""
    cached_disk_tokens: int = 0
    cached_remote_tokens: int = 0
    """Of prompt_tokens_cached, the tokens pulled from another prefill worker."""
    queued_tokens: int = 0
    """Prompt tokens admitted whose KV is not computed yet."""
    prefill_tokens_per_s: float = 0.0
    """Recent prompt throughput (0 until measured)."""
    node_id: str = ""
    """Holder id of the node's shared block store tier ("" without one)."""
    images_encoded: int = 0
    """A vision worker's images run through its encoder since start."""
    encoder_cache_hits: int = 0
    """A vision worker's images served from its encoder cache since start."""
    encode_seconds: list[float] = dataclasses.field(default_factory=list)
    """Durations of the encoder runs finished since the previous stats message."""
    loop_phases: list[PhaseSeconds] = dataclasses.field(default_factory=list)
    """Seconds of the loop by phase since start: the engine step's (schedule, forward, wait,
    outputs) and the worker's around it (idle, receive, reserve, adopt, worker, send, stats)."""
    loop_steps: int = 0
    """Engine steps taken since start."""
    hash_root: int = 0
    """The start of the worker's block hash chains (kvstore/hashing.py: hash_root; 0 for a
    vision worker, which hashes no blocks)."""
    spec_num_drafts: int = 0
    """Speculative decoding since start (engine/spec/): request-steps that verified drafts,
    draft tokens verified, those accepted, and accepted ones by draft position."""
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = dataclasses.field(default_factory=list)
    eplb_rebalances: int = 0
    """A rank of an expert-parallel group: its group's rebalances since start, and the rank
    load imbalance (max / mean, mean over MoE layers) of the interval before the last one,
    under the placement it ran with (engine/expert_rebalance.py)."""
    eplb_imbalance: float = 0.0


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

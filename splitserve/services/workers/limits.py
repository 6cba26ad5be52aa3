"""The largest message each worker socket takes (zmq.MAXMSGSIZE), from the deployment's
config: ZMQ drops the connection of a peer that announces a larger one before a byte of it is
buffered, so one oversized message cannot grow a worker by its size.

- Request sockets: a GenerateRequest, Reserve or Prefill carries the prompt's token ids (at
  most max_model_len, each at most TOKEN_BYTES in msgpack) and sampling parameters parsed from
  one request body (at most server.max_body_bytes of JSON; twice that for what the API server
  derives from it, a tool schema's constraint); a FetchBlocks one hash per prompt block. A
  vision worker's EncodeImages carries at most images.max_per_request images of
  images.max_bytes each.
- Tensor header sockets: a KvHeader, EmbeddingsHeader or PeerBlocks is a few ids, a tensor
  shape and at most one token's logprobs: HEADER_BYTES.
- Output sockets (PUSH): no message arrives on them; only the CURVE handshake's commands,
  which libzmq holds to the same limit (INITIATE is a few hundred bytes with its metadata).
"""

from __future__ import annotations

from splitserve.config import ImagesConfig

TOKEN_BYTES = 9
"""msgpack's largest integer: a token id or a block hash."""
ENVELOPE_BYTES = 64 << 10
"""The seal, the ids and the fields around the large ones."""
HEADER_BYTES = 64 << 10
OUTPUT_SOCKET_BYTES = 4 << 10


def request_bytes(max_body_bytes: int, max_model_len: int) -> int:
    """An engine worker's request socket: a prompt of max_model_len tokens and its body."""
    return 2 * max_body_bytes + 2 * TOKEN_BYTES * max_model_len + ENVELOPE_BYTES


def image_request_bytes(images: ImagesConfig) -> int:
    """A vision worker's request socket: one request's images."""
    return images.max_per_request * images.max_bytes + ENVELOPE_BYTES

"""What prefill and decode workers say to each other (msgspec structs over ZeroMQ).

The decode worker opens a DEALER socket to each prefill worker's bootstrap port (a ROUTER);
everything travels on that one channel:

    decode -> prefill   Register (where to write a room's KV), Ping, Cancel, Refuse
    prefill -> decode   Done (the KV is written; here is the first token), Failed, Pong,
                        Cancelled

The KV itself never passes here: the prefill worker writes it straight into the decode
worker's pool through the Mooncake Transfer Engine (transfer.py).

Every message is sealed with an HMAC-SHA256 tag keyed by the cluster's shared secret and
bound to its direction (`seal` / `unseal`): a message from anyone without the secret, or one
sent back the way it came, is dropped unread. A Ping's seq is a random nonce, so the Pong
that echoes it proves the prefill worker holds the secret now (not a replay); the decode
worker registers a room, which tells where its KV pool lies, only with a peer proven so.
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec

TO_PREFILL, TO_DECODE = b"P", b"D"
_TAG_BYTES = 32
MAX_MESSAGE_BYTES = 32 << 20  # a Register of a 1M-token prompt is ~5 MB


class KVLayout(msgspec.Struct, frozen=True):
    """Where a worker's KV pool lives in its memory, for a peer's transfer engine."""

    session: str  # the Mooncake session ("host:rpc_port") that owns this memory
    k_addrs: list[int]  # per layer: address of K slot 0
    v_addrs: list[int]
    slot_bytes: int  # one slot of one layer's K (or V): kv heads x head dim x element size
    kv_dtype: str  # the pool's element type ("bfloat16", "int8", "float8_e4m3fn", ...)
    # a quantized pool's float32 scales (one per slot and KV head), per layer; empty, 0 for a
    # float pool
    k_scale_addrs: list[int] = []
    v_scale_addrs: list[int] = []
    scale_slot_bytes: int = 0


class Register(msgspec.Struct, tag="register", frozen=True):
    """Decode -> prefill: write room's prompt positions [start, start + len(slots)) into these
    slots of my pool, then send me its first token."""

    room: int
    layout: KVLayout
    start: int
    slots: list[int]
    prompt_len: int
    lora_name: str | None = None  # the adapter the decode worker serves the request with


class Ping(msgspec.Struct, tag="ping", frozen=True):
    seq: int


class Pong(msgspec.Struct, tag="pong", frozen=True):
    seq: int
    # the prefill worker's pool dtype: the decode worker registers no room with a worker
    # whose KV it could not read
    kv_dtype: str = ""


class Cancel(msgspec.Struct, tag="cancel", frozen=True):
    """Decode -> prefill: the decode side gave the room up: stop writing to its slots."""

    room: int


class Refuse(msgspec.Struct, tag="refuse", frozen=True):
    """Decode -> prefill: the decode worker turned the room's request away at its door (a
    400: an adapter it lacks, ...): end your half of it now, not after the timeout."""

    room: int
    message: str


class Cancelled(msgspec.Struct, tag="cancelled", frozen=True):
    """Prefill -> decode: nothing more will be written for the room (its slots may be reused)."""

    room: int


class Done(msgspec.Struct, tag="done", frozen=True):
    """Prefill -> decode: every layer of the room's KV is written, and the first token."""

    room: int
    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[float, int]] | None = None
    num_bytes: int = 0
    prefill_cached_tokens: int = 0


class Failed(msgspec.Struct, tag="failed", frozen=True):
    room: int
    message: str
    status_code: int | None = None  # 400: the request cannot be served by this pair as sent


ToPrefill = Register | Ping | Cancel | Refuse
ToDecode = Done | Failed | Pong | Cancelled

_encoder = msgspec.msgpack.Encoder()
_to_prefill = msgspec.msgpack.Decoder(ToPrefill)
_to_decode = msgspec.msgpack.Decoder(ToDecode)


def encode(msg: ToPrefill | ToDecode) -> bytes:
    return _encoder.encode(msg)


def decode_to_prefill(data: bytes) -> ToPrefill:
    return _to_prefill.decode(data)


def decode_to_decode(data: bytes) -> ToDecode:
    return _to_decode.decode(data)


def seal(secret: bytes, direction: bytes, data: bytes) -> bytes:
    """`data` with its tag in front (direction: TO_PREFILL or TO_DECODE)."""
    return hmac.new(secret, direction + data, hashlib.sha256).digest() + data


def unseal(secret: bytes, direction: bytes, wire: bytes) -> bytes | None:
    """The message of a sealed `wire`; None when its tag is not the secret's (constant time)."""
    if len(wire) < _TAG_BYTES:
        return None
    tag, data = wire[:_TAG_BYTES], wire[_TAG_BYTES:]
    want = hmac.new(secret, direction + data, hashlib.sha256).digest()
    return data if hmac.compare_digest(tag, want) else None

"""The messages between an Engine and its engine-core process, as msgspec structs.

Requests go in one PUSH/PULL pipe, one message per frame (a batch call's requests in one);
outputs come back the other way, several per frame (everything one loop iteration produced).
Output dicts are the engine's own result dicts (`engine_io.build_output`): plain lists, numbers
and strings.
"""

from __future__ import annotations

from typing import Any

import msgspec


class ImageItem(msgspec.Struct, frozen=True):
    """One image of a prompt, preprocessed in the caller's process: its content hash, the pad
    value its prompt positions carry, the runs (start, length) of those positions in embedding
    order, and its pixels (float32, C order, `shape` [crops, 3, H, W])."""

    hash: int
    pad_value: int
    runs: list[tuple[int, int]]
    pixels: bytes
    shape: tuple[int, ...]
    # its rows attend to each other both ways (Gemma 3): prefilled in one chunk
    whole: bool = False


class GenerateReqInput(msgspec.Struct, tag="generate", frozen=True):
    """One request, tokenized and validated by the Engine (n > 1 arrives as n of these)."""

    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any]
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    # the caller's time.perf_counter() at submission (CLOCK_MONOTONIC: shared by processes)
    arrival_time: float = 0.0
    # prefill/decode disaggregation: where the pair meets (sglang-router's PD mode adds them)
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    # the tenant's namespace in the prefix cache: requests of different salts share no
    # cached prefix (vLLM's cache_salt; the server adds the caller's key to it)
    cache_salt: str | None = None
    # the LoRA adapter to run on (a loaded adapter's name); None: the base model
    lora_name: str | None = None
    # the prompt's images (a vision-language model); None: text only
    images: list[ImageItem] | None = None
    # an embedding request: "last" | "mean" pooling of the final hidden states (Engine.encode)
    pooling: str | None = None
    # its place in the waiting queue under priority scheduling (0 otherwise)
    priority: int = 0


class GenerateBatch(msgspec.Struct, tag="generate_batch", frozen=True):
    """The requests of one generate call (a batch of prompts, n > 1) in one frame: the core's
    loop takes them in one iteration, so the call is scheduled alike every time."""

    reqs: list[GenerateReqInput]


class AbortReq(msgspec.Struct, tag="abort", frozen=True):
    """Abort `rid` and the rids derived from it; `rid=None` aborts everything."""

    rid: str | None


class RpcReq(msgspec.Struct, tag="rpc", frozen=True):
    """Call one of EngineCore.RPC_METHODS on the loop thread; answered by an RpcReply."""

    call_id: int
    method: str
    kwargs: dict[str, Any] = msgspec.field(default_factory=dict)


class StopReq(msgspec.Struct, tag="stop", frozen=True):
    """Abort what is in flight (answering everyone) and exit."""


class ReqOutput(msgspec.Struct, tag="output", frozen=True):
    rid: str
    out: dict[str, Any]


class RpcReply(msgspec.Struct, tag="rpc_reply", frozen=True):
    call_id: int
    ok: bool
    value: Any = None
    error: str = ""
    # the method refused its input (it raised ValueError, with this message): the caller gets
    # a ValueError too, as the in-process core's caller does
    refused: str | None = None


class Ready(msgspec.Struct, tag="ready", frozen=True):
    """The core's first message: what it loaded (pickled CoreInfo), or why it could not."""

    info: bytes = b""
    error_type: str = ""
    error: str = ""


InMessage = GenerateReqInput | GenerateBatch | AbortReq | RpcReq | StopReq
OutMessage = ReqOutput | RpcReply | Ready

_encoder = msgspec.msgpack.Encoder()
_in_decoder = msgspec.msgpack.Decoder(InMessage)
_out_decoder = msgspec.msgpack.Decoder(list[OutMessage])


def encode(msg: InMessage | list[OutMessage]) -> bytes:
    return _encoder.encode(msg)


def decode_in(data: bytes) -> InMessage:
    return _in_decoder.decode(data)


def decode_out(data: bytes) -> list[OutMessage]:
    return _out_decoder.decode(data)

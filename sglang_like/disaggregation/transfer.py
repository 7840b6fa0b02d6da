"""KV transfer through the Mooncake Transfer Engine (PyPI `mooncake-transfer-engine-non-cuda`
on CPU machines; the CUDA wheel adds RDMA/NVLink transports with the same calls).

Each worker registers every layer's K and V buffer of its pool (and a quantized pool's K and V
scales) with its own engine; a prefill worker then writes a request's slots straight into the
decode worker's registered memory (`batch_transfer_sync_write`), one call per layer, so a
layer's KV travels while the next layers compute. Runs of consecutive slots on both sides go
as one buffer each. Both pools must hold the same dtype (`check_peer`).
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from sglang_like.disaggregation.messages import KVLayout

logger = logging.getLogger(__name__)


def slot_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the runs where both slot lists step by one."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source slots for {len(dst)} destination slots")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def reachable_host(host: str) -> str:
    """An address peers can reach this worker at, for a server bound to `host`."""
    if host in ("", "0.0.0.0", "::"):
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"
    return host


def kv_dtype_name(pool: Any) -> str:
    """The pool's element type as --kv-cache-dtype resolves it ("bfloat16", "int8",
    "float8_e4m3fn", ...): what both workers of a pair must agree on."""
    return str(pool.dtype).removeprefix("torch.")


class MooncakeKVTransfer:
    """One worker's Mooncake engine with its KV pool registered.

    What one token of one layer moves, per slot (a quantized pool's scales beside its codes):

        K codes  slot_bytes        V codes  slot_bytes
        K scales scale_slot_bytes  V scales scale_slot_bytes   (0 for a float pool)

    so a request's bytes are its tokens x the pool's bytes_per_slot.
    """

    def __init__(self, pool: Any, host: str) -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:  # a clear error where the package or libibverbs1 is missing
            raise RuntimeError(
                "prefill/decode disaggregation needs the Mooncake Transfer Engine: "
                "pip install mooncake-transfer-engine-non-cuda (CPU) and the system package "
                f"libibverbs1 (apt-get install -y libibverbs1): {exc}") from exc
        self.engine = TransferEngine()
        host = reachable_host(host)
        # P2PHANDSHAKE: peers exchange segment metadata directly, no metadata service
        rc = self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize failed ({rc})")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.pool = pool
        k_scales, v_scales = pool.k_scales or [], pool.v_scales or []
        for buf in (*pool.k_buffers, *pool.v_buffers, *k_scales, *v_scales):
            nbytes = buf.numel() * buf.element_size()
            rc = self.engine.register_memory(buf.data_ptr(), nbytes)
            if rc != 0:
                raise RuntimeError(f"Mooncake register_memory of {nbytes} bytes failed ({rc})")
        self.slot_bytes = _row_bytes(pool.k_buffers[0])
        self.scale_slot_bytes = _row_bytes(k_scales[0]) if k_scales else 0
        self.kv_dtype = kv_dtype_name(pool)
        self.layout = KVLayout(self.session, [b.data_ptr() for b in pool.k_buffers],
                               [b.data_ptr() for b in pool.v_buffers], self.slot_bytes,
                               self.kv_dtype, [b.data_ptr() for b in k_scales],
                               [b.data_ptr() for b in v_scales], self.scale_slot_bytes)
        self.bytes_sent = 0

    @property
    def num_layers(self) -> int:
        return len(self.pool.k_buffers)

    def check_peer(self, peer: KVLayout) -> str | None:
        """Why the peer's pool cannot take ours (None: it can)."""
        if peer.kv_dtype != self.kv_dtype:
            # same-sized codes of another type (int8 / fp8) would be read as garbage
            return (f"the decode worker's KV pool is {peer.kv_dtype}, this prefill worker's "
                    f"{self.kv_dtype}: both workers need the same --kv-cache-dtype")
        if len(peer.k_addrs) != self.num_layers:
            return f"the decode pool has {len(peer.k_addrs)} layers, this one {self.num_layers}"
        if peer.slot_bytes != self.slot_bytes or peer.scale_slot_bytes != self.scale_slot_bytes:
            return (f"a decode KV slot is {peer.slot_bytes} + {peer.scale_slot_bytes} bytes per "
                    f"layer, here {self.slot_bytes} + {self.scale_slot_bytes} (same model, "
                    "--kv-cache-dtype and --tp-size needed)")
        if self.scale_slot_bytes and (len(peer.k_scale_addrs) != self.num_layers
                                      or len(peer.v_scale_addrs) != self.num_layers):
            return "the decode pool's scales do not cover every layer"
        return None

    def write_layer(self, peer: KVLayout, layer: int, runs: list[tuple[int, int, int]]) -> int:
        """Write K and V of `layer` (and their scales) for `runs` into the peer's pool; bytes
        moved. Raises RuntimeError if the engine reports a failure (peer gone, refused)."""
        if not runs:
            return 0
        mine, theirs = self.layout, peer
        regions = [(mine.k_addrs, theirs.k_addrs, self.slot_bytes),
                   (mine.v_addrs, theirs.v_addrs, self.slot_bytes)]
        if self.scale_slot_bytes:
            regions += [(mine.k_scale_addrs, theirs.k_scale_addrs, self.scale_slot_bytes),
                        (mine.v_scale_addrs, theirs.v_scale_addrs, self.scale_slot_bytes)]
        srcs, dsts, lens = [], [], []
        for src_addrs, dst_addrs, stride in regions:
            src, dst = src_addrs[layer], dst_addrs[layer]
            for s, d, n in runs:
                srcs.append(src + s * stride)
                dsts.append(dst + d * stride)
                lens.append(n * stride)
        rc = self.engine.batch_transfer_sync_write(peer.session, srcs, dsts, lens)
        if rc != 0:
            raise RuntimeError(f"Mooncake write to {peer.session} failed ({rc})")
        moved = sum(lens)
        self.bytes_sent += moved
        return moved


def _row_bytes(buf: Any) -> int:
    """Bytes of one slot's row of a [slots, ...] buffer."""
    return buf[0].numel() * buf.element_size()

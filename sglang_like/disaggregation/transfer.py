"""KV transfer through the Mooncake Transfer Engine (PyPI `mooncake-transfer-engine-non-cuda`
on CPU machines; the CUDA wheel adds RDMA/NVLink transports with the same calls).

Each worker registers every layer's K and V buffer of its pool with its own engine; a
prefill worker then writes a request's slots straight into the decode worker's registered
memory (`batch_transfer_sync_write`), one call per layer, so a layer's KV travels while the
next layers compute. Runs of consecutive slots on both sides go as one buffer each.
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


class MooncakeKVTransfer:
    """One worker's Mooncake engine with its KV pool registered."""

    def __init__(self, pool: Any, host: str) -> None:
        if getattr(pool, "k_scales", None) is not None:
            # the transfer moves K and V rows only: a quantized pool's scales would not follow
            raise ValueError("PD disaggregation does not move a quantized KV pool (int8 / fp8) "
                             "yet: run both workers with --kv-cache-dtype auto or bfloat16")
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
        buffers = [*pool.k_buffers, *pool.v_buffers]
        for buf in buffers:
            nbytes = buf.numel() * buf.element_size()
            rc = self.engine.register_memory(buf.data_ptr(), nbytes)
            if rc != 0:
                raise RuntimeError(f"Mooncake register_memory of {nbytes} bytes failed ({rc})")
        first = pool.k_buffers[0]
        self.slot_bytes = first[0].numel() * first.element_size()
        self.layout = KVLayout(self.session, [b.data_ptr() for b in pool.k_buffers],
                               [b.data_ptr() for b in pool.v_buffers], self.slot_bytes)
        self.bytes_sent = 0

    @property
    def num_layers(self) -> int:
        return len(self.pool.k_buffers)

    def check_peer(self, peer: KVLayout) -> str | None:
        """Why the peer's pool cannot take ours (None: it can)."""
        if len(peer.k_addrs) != self.num_layers:
            return f"the decode pool has {len(peer.k_addrs)} layers, this one {self.num_layers}"
        if peer.slot_bytes != self.slot_bytes:
            return (f"a decode KV slot is {peer.slot_bytes} bytes per layer, here "
                    f"{self.slot_bytes} (same model, --kv-cache-dtype and --tp-size needed)")
        return None

    def write_layer(self, peer: KVLayout, layer: int, runs: list[tuple[int, int, int]]) -> int:
        """Write K and V of `layer` for `runs` into the peer's pool; bytes moved. Raises
        RuntimeError if the engine reports a failure (peer gone, refused)."""
        if not runs:
            return 0
        stride = self.slot_bytes
        k_src, v_src = self.layout.k_addrs[layer], self.layout.v_addrs[layer]
        k_dst, v_dst = peer.k_addrs[layer], peer.v_addrs[layer]
        srcs, dsts, lens = [], [], []
        for s, d, n in runs:
            srcs += (k_src + s * stride, v_src + s * stride)
            dsts += (k_dst + d * stride, v_dst + d * stride)
            lens += (n * stride, n * stride)
        rc = self.engine.batch_transfer_sync_write(peer.session, srcs, dsts, lens)
        if rc != 0:
            raise RuntimeError(f"Mooncake write to {peer.session} failed ({rc})")
        moved = sum(lens)
        self.bytes_sent += moved
        return moved

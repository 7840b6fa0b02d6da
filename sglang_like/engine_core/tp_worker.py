"""A tensor-parallel rank > 0: `python -m sglang_like.engine_core.tp_worker ARGS_FILE` (started by
TPGroup, never by hand).

It loads the checkpoint itself, keeps its shard, allocates a KV pool of rank 0's size (read
from the group's store once rank 0 has placed its weights), says "ready" there, then runs
every batch rank 0 sends through its layers (no logits, nothing sent back: the all-reduces
inside the layers are the only exchange). It exits on the stop message, when rank 0's
process is gone, or when a collective fails (rank 0 then sees it gone). LoRA adapters arrive
whole on the same socket, ahead of the batches that use them; it keeps its own part of each
until told to drop it.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable

import torch
import zmq

from sglang_like.layers.lora import LoraLinearWeights
from sglang_like.tp.broadcast import (
    KIND_LORA_DROP,
    KIND_LORA_LOAD,
    KIND_STOP,
    decode_batch,
    decode_kind,
    decode_lora_load,
    decode_uid,
)
from sglang_like.tp.comm import GroupAllReduce, ShmAllReduce, TPRankLost, make_process_group
from sglang_like.tp.group import AllReduceSlot, wait_num_kv_slots
from sglang_like.tp.parallel import TPShard, make_shard_plan, shard_lora

logger = logging.getLogger("sglang_like.engine_core.tp_worker")

_PARENT_POLL_MS = 500


def _build_runner(spec: dict, slot: AllReduceSlot, device: torch.device,  # noqa: ANN202
                  num_kv_slots: Callable[[int], int]):
    from sglang_like.layers.quantization import QuantConfig
    from sglang_like.model_loader import load_model
    from sglang_like.model_runner import ModelRunner

    sa = spec["server_args"]  # every "auto" resolved by rank 0
    dtype = getattr(torch, sa.dtype)  # e.g. "float32", as rank 0 resolved it
    keep_packed = device.type == "cpu" and sa.quantization != "none"
    loaded = load_model(sa.model_path, dtype, keep_packed=keep_packed)
    plan = make_shard_plan(loaded.config, spec["tp_size"], spec["rank"])
    return ModelRunner(
        loaded.config, loaded.weights, dtype=dtype, device=device,
        num_kv_slots=num_kv_slots, context_len=sa.context_length,
        max_running_requests=sa.max_running_requests, quant=QuantConfig(
            sa.quantization, dtype, deterministic=sa.enable_deterministic_inference),
        kv_dtype=getattr(torch, sa.kv_cache_dtype),
        tp=TPShard(plan, slot.all_reduce),
    )


def main(args_path: str) -> int:
    with open(args_path, "rb") as f:
        spec = pickle.load(f)
    sa, rank, tp_size = spec["server_args"], spec["rank"], spec["tp_size"]
    logging.basicConfig(level=sa.log_level.upper(),
                        format=f"[%(asctime)s] %(levelname)s tp{rank}: %(message)s",
                        datefmt="%H:%M:%S")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when the group stops
    torch.set_num_threads(spec["num_threads"])
    parent_pid = spec["parent_pid"]

    def parent_error() -> str | None:
        return None if os.getppid() == parent_pid else "tensor-parallel rank 0 is gone"

    timeout = datetime.timedelta(seconds=spec["timeout_s"])
    store = torch.distributed.FileStore(spec["store_path"], tp_size)
    store.set_timeout(timeout)
    device = (torch.device("cuda", rank) if sa.device.startswith("cuda")
              else torch.device(sa.device))
    slot = AllReduceSlot()
    try:
        if spec["allreduce"] == "shm":
            slot.comm = ShmAllReduce(spec["shm_path"], rank, tp_size, spec["shm_slot_bytes"],
                                     parent_error, spec["timeout_s"])
        # the pool after the weights, of rank 0's size (which it may know only then)
        runner = _build_runner(spec, slot, device,
                               lambda _: wait_num_kv_slots(store, parent_error))
    except BaseException as exc:  # noqa: BLE001 - told to rank 0, which raises it
        store.set(f"tp/ready/{rank}", f"{type(exc).__name__}: {exc}".encode()
                  or traceback.format_exc().encode())
        return 1
    # connected before "ready": rank 0 may send its first batch as soon as the group forms
    sock = zmq.Context().socket(zmq.PULL)
    sock.connect(spec["batch_addr"])
    store.set(f"tp/ready/{rank}", b"ok")
    if slot.comm is None:
        group = make_process_group(store, rank, tp_size, device, spec["timeout_s"])
        slot.comm = GroupAllReduce(group, parent_error)
    logger.debug("rank %d of %d ready (pid %d)", rank, tp_size, os.getpid())
    plan = make_shard_plan(runner.model_config, tp_size, rank)
    loras: dict[int, dict[str, LoraLinearWeights]] = {}  # this rank's parts, by uid
    try:
        while True:
            if not sock.poll(_PARENT_POLL_MS):
                if parent_error() is not None:
                    logger.warning("rank 0 is gone; stopping")
                    return 0
                continue
            frames = sock.recv_multipart()
            kind = decode_kind(frames)
            if kind == KIND_STOP:
                return 0
            if kind == KIND_LORA_LOAD:
                uid, weights = decode_lora_load(frames)
                part = shard_lora(weights, runner.model_config, plan)
                loras[uid] = {k: LoraLinearWeights(w.a.to(device), w.b.to(device))
                              for k, w in part.items()}
            elif kind == KIND_LORA_DROP:
                del loras[decode_uid(frames)]
            else:
                runner.run_shard(decode_batch(frames, device, loras))
    except TPRankLost as exc:
        logger.error("stopping: %s", exc)
        return 1
    finally:
        sock.close(linger=0)
        slot.comm.close()  # a process group torn down at interpreter exit aborts the process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

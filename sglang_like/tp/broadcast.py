"""How a ForwardBatch travels from rank 0 to the other ranks: a few zmq frames of raw ints.

    frame 0  int64  header [kind, T, B, W, is_decode, mask_kind, N, G]
                    (+ 2B mask shapes when mask_kind is CUSTOM)
                    (+ G adapter ids, then each row's group 0..G-1 or -1 [T], when G > 0)
                    + input_ids[T] positions[T] out_slots[T] prefix_lens[B] extend_lens[B]
    frame 1  int32  req_to_token rows of the batch's requests [B, W] (W: the widest key range
                    any request reads); the receiver's req_pool_indices are 0..B-1
    frame 2  uint8  the masks, when there are any: custom masks concatenated, or the
                    [B, N, N] tree mask

Only what the other ranks' layers read travels: not logits_indices (rank 0 alone computes
logits), not the on_layer hook. A batch's LoRA rows name their adapters by id (the registry's
`uid` of that load); the adapters themselves travel once, in a load message ahead of the
first batch that uses them (`encode_lora_load`), and a drop message ends them.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
import numpy as np
import torch

from sglang_like.forward_batch import ForwardBatch
from sglang_like.layers.lora import LoraBatch, LoraLinearWeights

KIND_FORWARD = 1
KIND_STOP = 2
KIND_LORA_LOAD = 3  # [header with the adapter's id] + its weights (msgpack)
KIND_LORA_DROP = 4  # [header with the adapter's id]
_MASK_NONE, _MASK_CUSTOM, _MASK_TREE = 0, 1, 2
_HEADER_LEN = 8


def encode_stop() -> list[bytes]:
    """The message that ends a worker's loop."""
    return [_header(KIND_STOP, 0)]


def encode_batch(fb: ForwardBatch, lora_uids: list[int] | None = None
                 ) -> list[memoryview | bytes]:
    """The frames of `fb` (tensors on any device; copied to the CPU once); `lora_uids`: the
    adapter id of each of `fb.lora`'s groups (None when `fb.lora` is)."""
    num_tokens, batch_size = fb.num_tokens, fb.batch_size
    mask_kind, num_draft, mask_shapes, key_lens = _MASK_NONE, 0, [], fb.seq_lens
    masks: bytes | None = None
    if fb.custom_masks is not None:
        mask_kind = _MASK_CUSTOM
        mask_shapes = [d for mask in fb.custom_masks for d in mask.shape]
        cols = torch.tensor(mask_shapes[1::2], dtype=torch.long, device=fb.prefix_lens.device)
        key_lens = torch.maximum(key_lens, fb.prefix_lens + cols)
        masks = b"".join(m.cpu().numpy().tobytes() for m in fb.custom_masks)
    elif fb.tree_mask is not None:
        mask_kind, num_draft = _MASK_TREE, int(fb.tree_mask.shape[1])
        masks = fb.tree_mask.cpu().numpy().tobytes()
    width = int(key_lens.max()) if batch_size else 0
    uids = lora_uids or []
    assert len(uids) == (0 if fb.lora is None else len(fb.lora.groups)), uids
    header = torch.tensor([KIND_FORWARD, num_tokens, batch_size, width, int(fb.is_decode),
                           mask_kind, num_draft, len(uids), *mask_shapes, *uids],
                          dtype=torch.long)
    lora = [fb.lora.row_groups()] if uids else []
    ints = torch.cat([header, *lora, fb.input_ids.cpu(), fb.positions.cpu(), fb.out_slots.cpu(),
                      fb.prefix_lens.cpu(), fb.extend_lens.cpu()])
    table = fb.req_to_token[fb.req_pool_indices, :width].cpu()
    frames: list[memoryview | bytes] = [ints.numpy().data, table.numpy().data]
    if masks is not None:
        frames.append(masks)
    return frames


def encode_lora_load(uid: int, weights: dict[str, LoraLinearWeights]) -> list[bytes]:
    """The message that gives the workers adapter `uid`'s weights whole (each cuts its own
    part): per linear key, A and B as [shape, float32 bytes]."""
    def pack(t: torch.Tensor) -> list:
        return [list(t.shape), t.detach().float().cpu().contiguous().numpy().tobytes()]

    body = {key: [pack(w.a), pack(w.b)] for key, w in weights.items()}
    return [_header(KIND_LORA_LOAD, uid), msgspec.msgpack.encode(body)]


def encode_lora_drop(uid: int) -> list[bytes]:
    """The message that frees adapter `uid` on the workers (no request holds it any more)."""
    return [_header(KIND_LORA_DROP, uid)]


def decode_lora_load(frames: list[bytes]) -> tuple[int, dict[str, LoraLinearWeights]]:
    """(uid, the adapter's weights, on the CPU) of a load message."""
    def unpack(item: list) -> torch.Tensor:
        shape, data = item
        return torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(shape)

    body = msgspec.msgpack.decode(frames[1])
    return decode_uid(frames), {key: LoraLinearWeights(unpack(a), unpack(b))
                                for key, (a, b) in body.items()}


def decode_uid(frames: list[bytes]) -> int:
    """The adapter id of a load or drop message."""
    return int(np.frombuffer(frames[0], dtype=np.int64, count=2)[1])


def _header(kind: int, value: int) -> bytes:
    return np.array([kind, value] + [0] * (_HEADER_LEN - 2), dtype=np.int64).tobytes()


def decode_kind(frames: list[bytes]) -> int:
    return int(np.frombuffer(frames[0], dtype=np.int64, count=1)[0])


def decode_batch(frames: list[bytes], device: torch.device,
                 loras: Mapping[int, dict[str, LoraLinearWeights]] | None = None
                 ) -> ForwardBatch:
    """The ForwardBatch a worker runs (req_pool_indices index the shipped rows); `loras`:
    the worker's parts of the adapters it was sent, by id."""
    ints = torch.from_numpy(np.frombuffer(frames[0], dtype=np.int64).copy())
    (kind, num_tokens, batch_size, width, is_decode, mask_kind, num_draft,
     num_groups) = ints[:_HEADER_LEN].tolist()
    assert kind == KIND_FORWARD, kind
    at = _HEADER_LEN
    shapes: list[int] = []
    if mask_kind == _MASK_CUSTOM:
        shapes = ints[at : at + 2 * batch_size].tolist()
        at += 2 * batch_size
    lora = None
    if num_groups:
        uids = ints[at : at + num_groups].tolist()
        slots = ints[at + num_groups : at + num_groups + num_tokens]
        at += num_groups + num_tokens
        lora = LoraBatch.from_row_groups([loras[u] for u in uids], slots, device)
    sizes = [num_tokens] * 3 + [batch_size] * 2
    input_ids, positions, out_slots, prefix_lens, extend_lens = (
        t.to(device) for t in ints[at : at + sum(sizes)].split(sizes))
    table = np.frombuffer(frames[1], dtype=np.int32).copy().reshape(batch_size, width)
    custom_masks = tree_mask = None
    if mask_kind == _MASK_CUSTOM:
        flat = torch.from_numpy(np.frombuffer(frames[2], dtype=np.bool_).copy())
        numels = [r * c for r, c in zip(shapes[0::2], shapes[1::2], strict=True)]
        custom_masks = [m.view(r, c).to(device) for m, r, c in
                        zip(flat.split(numels), shapes[0::2], shapes[1::2], strict=True)]
    elif mask_kind == _MASK_TREE:
        flat = np.frombuffer(frames[2], dtype=np.bool_).copy()
        tree_mask = torch.from_numpy(flat).view(batch_size, num_draft, num_draft).to(device)
    return ForwardBatch(
        input_ids=input_ids, positions=positions, out_slots=out_slots,
        req_pool_indices=torch.arange(batch_size, device=device),
        prefix_lens=prefix_lens, extend_lens=extend_lens,
        logits_indices=torch.empty(0, dtype=torch.long, device=device),
        req_to_token=torch.from_numpy(table).to(device),
        tree_mask=tree_mask, custom_masks=custom_masks, is_decode=bool(is_decode),
        lora=lora,
    )

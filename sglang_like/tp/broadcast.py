"""How a ForwardBatch travels from rank 0 to the other ranks: a few zmq frames of raw ints.

    frame 0  int64  header [kind, T, B, W, is_decode, mask_kind, N]
                    (+ 2B mask shapes when mask_kind is CUSTOM)
                    + input_ids[T] positions[T] out_slots[T] prefix_lens[B] extend_lens[B]
    frame 1  int32  req_to_token rows of the batch's requests [B, W] (W: the widest key range
                    any request reads); the receiver's req_pool_indices are 0..B-1
    frame 2  uint8  the masks, when there are any: custom masks concatenated, or the
                    [B, N, N] tree mask

Only what the other ranks' layers read travels: not logits_indices (rank 0 alone computes
logits), not the on_layer hook.
"""

from __future__ import annotations

import numpy as np
import torch

from sglang_like.forward_batch import ForwardBatch

KIND_FORWARD = 1
KIND_STOP = 2
_MASK_NONE, _MASK_CUSTOM, _MASK_TREE = 0, 1, 2
_HEADER_LEN = 7


def encode_stop() -> list[bytes]:
    """The message that ends a worker's loop."""
    return [np.array([KIND_STOP] + [0] * (_HEADER_LEN - 1), dtype=np.int64).tobytes()]


def encode_batch(fb: ForwardBatch) -> list[memoryview | bytes]:
    """The frames of `fb` (tensors on any device; copied to the CPU once)."""
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
    header = torch.tensor([KIND_FORWARD, num_tokens, batch_size, width, int(fb.is_decode),
                           mask_kind, num_draft, *mask_shapes], dtype=torch.long)
    ints = torch.cat([header, fb.input_ids.cpu(), fb.positions.cpu(), fb.out_slots.cpu(),
                      fb.prefix_lens.cpu(), fb.extend_lens.cpu()])
    table = fb.req_to_token[fb.req_pool_indices, :width].cpu()
    frames: list[memoryview | bytes] = [ints.numpy().data, table.numpy().data]
    if masks is not None:
        frames.append(masks)
    return frames


def decode_kind(frames: list[bytes]) -> int:
    return int(np.frombuffer(frames[0], dtype=np.int64, count=1)[0])


def decode_batch(frames: list[bytes], device: torch.device) -> ForwardBatch:
    """The ForwardBatch a worker runs (req_pool_indices index the shipped rows)."""
    ints = torch.from_numpy(np.frombuffer(frames[0], dtype=np.int64).copy())
    kind, num_tokens, batch_size, width, is_decode, mask_kind, num_draft = ints[:7].tolist()
    assert kind == KIND_FORWARD, kind
    at = _HEADER_LEN
    shapes: list[int] = []
    if mask_kind == _MASK_CUSTOM:
        shapes = ints[at : at + 2 * batch_size].tolist()
        at += 2 * batch_size
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
    )

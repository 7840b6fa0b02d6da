"""utils.upload.Packer: ints, 63-bit ints and floats (exact as float64) come back from the one
buffer as they went in, in order; empty parts and an empty packer included."""

from __future__ import annotations

import torch

from sglang_like.utils.upload import Packer


def test_parts_come_back_exact() -> None:
    pack = Packer()
    ints = pack.add([3, -1, 2**62 + 7])
    floats = pack.add([0.1, -2.5, float("-inf")], is_float=True)
    empty = pack.add([])
    mask = pack.add(torch.tensor([[-1, 5]], dtype=torch.int32))
    parts = pack.to(torch.device("cpu"))
    assert parts[ints].tolist() == [3, -1, 2**62 + 7]
    assert parts[floats].view(torch.float64).tolist() == [0.1, -2.5, float("-inf")]
    assert parts[empty].numel() == 0
    assert parts[mask].to(torch.int32).tolist() == [-1, 5]
    assert all(p.dtype == torch.int64 for p in parts)


def test_an_empty_packer_gives_nothing() -> None:
    assert Packer().to(torch.device("cpu")) == []

"""Packing a step's host data into one host-to-device copy.

On a GPU each `torch.tensor(list, device="cuda")` is a copy of its own from pageable memory,
which waits for the stream before it starts; a step used to make one per metadata tensor and
one per request's KV row. `Packer` gathers them into one int64 buffer, copied once (pinned
and asynchronous on CUDA), and hands back views of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class Packer:
    """Host arrays packed into one int64 buffer so that they cross in a single copy: floats
    ride as float64 bit patterns (an int64 view), which keeps 63-bit integers (seeds) and the
    floats exact in one dtype."""

    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []

    def add(self, values: Sequence[Any] | torch.Tensor, is_float: bool = False) -> int:
        """Append `values` (ints, nested lists of them, or floats with `is_float`; a tensor is
        taken as ints), flattened; returns its index in `to`'s list."""
        if is_float:
            part = torch.tensor(values, dtype=torch.float64).view(torch.int64)
        elif isinstance(values, torch.Tensor):
            part = values.reshape(-1).to(torch.int64)
        else:
            part = torch.tensor(values, dtype=torch.int64)
        self._parts.append(part.reshape(-1))
        return len(self._parts) - 1

    def to(self, device: torch.device) -> list[torch.Tensor]:
        """Every part on `device` as a 1-D int64 view (a float part: `.view(torch.float64)`
        gives it back), from one copy."""
        buf = torch.cat(self._parts) if self._parts else torch.empty(0, dtype=torch.int64)
        if device.type == "cuda":
            buf = buf.pin_memory().to(device, non_blocking=True)
        else:
            buf = buf.to(device)
        return list(buf.split([p.numel() for p in self._parts]))


def upload_ints(parts: list[Sequence[int]], device: torch.device) -> list[torch.Tensor]:
    """Each list as an int64 tensor on `device`: off the CPU views of one copy (`Packer`),
    not a copy each; on the CPU a tensor each."""
    if device.type == "cpu":
        return [torch.tensor(p, dtype=torch.long) for p in parts]
    pack = Packer()
    for p in parts:
        pack.add(p)
    return pack.to(device)

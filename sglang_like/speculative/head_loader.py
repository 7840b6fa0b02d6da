"""Loading a draft head folder of either kind: EAGLE-3 (`eagle_head`) or EAGLE-1/2
(`eagle1_head`). Its own module, above both: the EAGLE-1/2 head is built from the EAGLE-3
head's parts, so the dispatch cannot live in `eagle_head` without an import circle."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from sglang_like.speculative import eagle1_head, eagle_head


def _head_kind(folder: str) -> tuple[str, dict]:
    """(the head's architecture, its config.json) with the errors both callers give"""
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"draft model folder {folder!r} has no config.json")
    with open(config_path, encoding="utf-8") as f:
        raw = json.load(f)
    arch = (raw.get("architectures") or [eagle_head.ARCHITECTURE])[0]
    if arch not in (eagle1_head.ARCHITECTURE, eagle_head.ARCHITECTURE):
        raise ValueError(f"draft model {folder!r}: architectures {raw.get('architectures')}; "
                         f"expected {eagle_head.ARCHITECTURE!r} (EAGLE-3) or "
                         f"{eagle1_head.ARCHITECTURE!r} (EAGLE-1/2)")
    return arch, raw


def load_draft_head(folder: str, device: torch.device | str = "cpu"
                    ) -> eagle_head.Eagle3Head | eagle1_head.Eagle1Head:
    """An EAGLE-3 head (`eagle_head.load_eagle3_head`) or an EAGLE-1/2 one
    (`eagle1_head.load_eagle1_head`), as its config.json's architectures say."""
    arch, raw = _head_kind(folder)
    if arch == eagle1_head.ARCHITECTURE:
        return eagle1_head.load_eagle1_head(folder, raw, device)
    return eagle_head.load_eagle3_head(folder, device)


def draft_head_footprint(folder: str, dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """(bytes, bytes per token) the head at `folder` will hold on its device, read without
    loading it: its weights in `dtype` (the drafter's, eagle.head_dtype; from the module
    built on the meta device) and its drafter's one-layer KV pool in it. On CUDA the
    target's pool is sized before the drafter exists, so these come off its budget first."""
    from sglang_like.mem_pool import KVPool

    arch, raw = _head_kind(folder)
    if arch == eagle1_head.ARCHITECTURE:
        config: Any = eagle1_head.Eagle1Config.from_json(raw)
        cls: Any = eagle1_head.Eagle1Head
    else:
        config, cls = eagle_head.Eagle3Config.from_json(raw), eagle_head.Eagle3Head
    with torch.device("meta"):
        head = cls(config).to(dtype)
    weights = sum(t.numel() * t.element_size()
                  for t in (*head.parameters(), *head.buffers()))
    return weights, KVPool.bytes_per_token(1, config.num_key_value_heads, config.head_dim,
                                           dtype)

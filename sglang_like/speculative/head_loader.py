"""Loading a draft head folder of either kind: EAGLE-3 (`eagle_head`) or EAGLE-1/2
(`eagle1_head`). Its own module, above both: the EAGLE-1/2 head is built from the EAGLE-3
head's parts, so the dispatch cannot live in `eagle_head` without an import circle."""

from __future__ import annotations

import json
import os

import torch

from sglang_like.speculative import eagle1_head, eagle_head


def load_draft_head(folder: str, device: torch.device | str = "cpu"
                    ) -> eagle_head.Eagle3Head | eagle1_head.Eagle1Head:
    """An EAGLE-3 head (`eagle_head.load_eagle3_head`) or an EAGLE-1/2 one
    (`eagle1_head.load_eagle1_head`), as its config.json's architectures say."""
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"draft model folder {folder!r} has no config.json")
    with open(config_path, encoding="utf-8") as f:
        raw = json.load(f)
    archs = raw.get("architectures") or [eagle_head.ARCHITECTURE]
    if archs[0] == eagle1_head.ARCHITECTURE:
        return eagle1_head.load_eagle1_head(folder, raw, device)
    if archs[0] != eagle_head.ARCHITECTURE:
        raise ValueError(f"draft model {folder!r}: architectures {archs}; expected "
                         f"{eagle_head.ARCHITECTURE!r} (EAGLE-3) or "
                         f"{eagle1_head.ARCHITECTURE!r} (EAGLE-1/2)")
    return eagle_head.load_eagle3_head(folder, device)

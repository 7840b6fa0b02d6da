"""Speculative decoding: drafters propose a token tree per request, one verify forward of the
target checks every node, and the scheduler commits the longest prefix the target agrees with.

- NGRAM: continuations of the request's own earlier text, or of recent requests' (`ngram.py`);
- EAGLE / EAGLE3: a one-layer draft head over the target's features (`eagle.py`; the head for
  the default model ships in `heads/`, trained by `train_eagle.py`), with NGRAM's
  continuation grafted onto its tree (`tree.with_copies`) unless turned off.

Acceptance walks the tree through the ordinary per-token path (sampler, grammar, stop checks),
so it is lossless: greedy output equals non-speculative output, and sampling draws every token
from the target's distribution (SGLang's target-only verify).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sglang_like.config import SPECULATIVE_ALGORITHMS, ServerArgs
from sglang_like.req import SpecState  # re-exported: it lived here before it moved to req
from sglang_like.speculative.controller import SpecController

if TYPE_CHECKING:
    from sglang_like.speculative.ngram import NgramDrafter
    from sglang_like.speculative.tree import DraftTree

# The torch-using parts load on first use: importing this package (the engine's set-up, a
# test's SpecController) must not pay for torch.
_LAZY = {"NgramDrafter": "sglang_like.speculative.ngram",
         "DraftTree": "sglang_like.speculative.tree"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["DEFAULT_HEAD", "DraftTree", "NgramDrafter", "SpecConfig", "SpecController",
           "SpecState", "resolve_spec_config"]

DEFAULT_HEAD = os.path.join(os.path.dirname(__file__), "heads", "smollm2-135m-instruct-eagle3")
"""The EAGLE-3 head trained here for the default model (sglang_like/speculative/heads)."""

# (num_steps, eagle_topk, num_draft_tokens) when not given. A chain: on CPU a verify row costs
# a good part of a decode step, so a few likely tokens beat a wide tree (SGLang's 3/1/4).
_EAGLE_DEFAULTS = (3, 1, 4)
_NGRAM_DRAFT_TOKENS = 6


@dataclass(frozen=True)
class SpecConfig:
    algorithm: str  # "EAGLE" | "EAGLE3" | "NGRAM"
    num_steps: int
    eagle_topk: int
    num_draft_tokens: int  # nodes per tree, root included
    draft_model_path: str | None
    ngram_min_window: int
    ngram_max_window: int
    ngram_breadth: int
    auto_disable: bool
    ngram_capacity: int = 0  # tokens of finished requests' text kept for lookups
    # EAGLE/EAGLE3: NGRAM's continuation grafted onto the head's tree (eagle.py)
    ngram_branch: bool = False

    @property
    def is_eagle(self) -> bool:
        return self.algorithm in ("EAGLE", "EAGLE3")


def resolve_spec_config(sa: ServerArgs, default_model: bool) -> SpecConfig | None:
    """The speculative settings of `sa` with defaults filled in; None when off. Bad values
    are a ValueError."""
    algo = sa.speculative_algorithm
    if algo is None:
        return None
    algo = algo.upper()
    if algo not in SPECULATIVE_ALGORITHMS:
        raise ValueError(f"speculative_algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)}"
                         f"; got {sa.speculative_algorithm!r}")
    path = sa.speculative_draft_model_path

    def given(value: int | None, default: int) -> int:
        return default if value is None else value

    if algo == "NGRAM":
        steps = given(sa.speculative_num_steps, _NGRAM_DRAFT_TOKENS - 1)
        topk = 1
        draft = given(sa.speculative_num_draft_tokens, steps + 1)
    else:
        d_steps, d_topk, d_draft = _EAGLE_DEFAULTS
        steps = given(sa.speculative_num_steps, d_steps)
        topk = given(sa.speculative_eagle_topk, d_topk)
        draft = given(sa.speculative_num_draft_tokens,
                      d_draft if (steps, topk) == (d_steps, d_topk) else min(steps * topk, 64) + 1)
        if path is None:
            if not default_model:
                raise ValueError(f"--speculative-algorithm {algo} needs "
                                 "--speculative-draft-model-path for a model other than the "
                                 "default (the shipped head is trained for SmolLM2-135M)")
            path = DEFAULT_HEAD
        if not os.path.isdir(path):
            raise ValueError(f"--speculative-draft-model-path {path!r} is not a folder")
    for name, value, low in (("num_steps", steps, 1), ("eagle_topk", topk, 1),
                             ("num_draft_tokens", draft, 2),
                             ("ngram_min_match_window_size",
                              sa.speculative_ngram_min_match_window_size, 1),
                             ("ngram_max_bfs_breadth", sa.speculative_ngram_max_bfs_breadth, 1),
                             ("ngram_capacity", sa.speculative_ngram_capacity, 0)):
        if value < low:
            raise ValueError(f"speculative_{name} must be at least {low}; got {value}")
    if sa.speculative_ngram_max_match_window_size < sa.speculative_ngram_min_match_window_size:
        raise ValueError("speculative_ngram_max_match_window_size is below the min window size")
    if algo != "NGRAM" and draft > steps * topk + 1:
        raise ValueError(f"speculative_num_draft_tokens {draft} exceeds what {steps} steps of "
                         f"top-{topk} can draft ({steps * topk + 1}, root included)")
    return SpecConfig(algo, steps, topk, draft, path,
                      sa.speculative_ngram_min_match_window_size,
                      sa.speculative_ngram_max_match_window_size,
                      sa.speculative_ngram_max_bfs_breadth, sa.speculative_auto_disable,
                      sa.speculative_ngram_capacity,
                      algo != "NGRAM" and sa.speculative_eagle_ngram_branch)

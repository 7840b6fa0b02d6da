"""Model families, one file each, built from `sglang_like.layers`; `registry` maps a
checkpoint's architecture to its family's class."""

from sglang_like.models.registry import FAMILIES, ModelFamily, model_class

__all__ = ["FAMILIES", "ModelFamily", "model_class"]

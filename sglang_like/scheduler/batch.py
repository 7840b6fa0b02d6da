"""ScheduleBatch lives in `sglang_like.schedule_batch` (below the model runner and the
drafters, which read it); this name stays for the imports that still use it."""

from sglang_like.schedule_batch import ScheduleBatch, VerifyTree

__all__ = ["ScheduleBatch", "VerifyTree"]

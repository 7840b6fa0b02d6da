"""The scheduler: one `Scheduler.step()` admits, batches, runs the model and processes outputs.

Its parts, each a module here: `batch` (a step's requests and tensors), `policy` (admission
order), `cache_manager` (radix-tree matching, locking, slot allocation, eviction),
`output_processor` (tokens -> finished requests, the tree insert), `spec_propose` and
`spec_verify` (the speculative step: drafters' trees in, accepted tokens out). Drafters and
prefill/decode disaggregation plug in through the Protocols in `plugins`; they are handed a
narrow context, never the Scheduler.
"""

from sglang_like.scheduler.scheduler import Scheduler, SchedulerConfig

__all__ = ["Scheduler", "SchedulerConfig"]

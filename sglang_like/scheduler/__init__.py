"""The scheduler: one `Scheduler.step()` admits, batches, runs the model and processes outputs.

Its parts, each a module here: `config` (its knobs), `policy` (admission order),
`cache_manager` (radix-tree matching, locking, slot allocation, eviction), `output_processor`
(tokens -> finished requests, the tree insert), `spec_propose` and `spec_verify` (the
speculative step: drafters' trees in, accepted tokens out). A step's batch (`ScheduleBatch`)
lives in `sglang_like.schedule_batch`, below the model runner and the drafters that read it.
Drafters and prefill/decode disaggregation plug in
through the Protocols in `plugins`; they are handed a narrow context, never the Scheduler.
"""

from sglang_like.scheduler.config import SchedulerConfig
from sglang_like.scheduler.scheduler import Scheduler

__all__ = ["Scheduler", "SchedulerConfig"]

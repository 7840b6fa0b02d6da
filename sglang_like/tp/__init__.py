"""Tensor parallelism (`--tp-size N`): the model split over N engine-core ranks.

Rank 0 is the engine core: it schedules, samples and hands each forward's batch to ranks
1..N-1 (`sglang_like.engine_core.tp_worker` processes), which run the same forward on their
shards; the row-parallel linears' partial sums are all-reduced. See `parallel` for the split.
"""

from sglang_like.tp.comm import GroupAllReduce, ShmAllReduce, TPRankLost
from sglang_like.tp.parallel import (
    MLP_CHUNK,
    ShardPlan,
    TPShard,
    check_tp_size,
    make_shard_plan,
    shard_lora,
    shard_weights,
    slice_cols,
    slice_rows,
)

__all__ = [
    "MLP_CHUNK",
    "GroupAllReduce",
    "ShardPlan",
    "ShmAllReduce",
    "TPRankLost",
    "TPShard",
    "check_tp_size",
    "make_shard_plan",
    "shard_lora",
    "shard_weights",
    "slice_cols",
    "slice_rows",
]

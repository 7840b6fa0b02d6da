"""ReqToTokenPool's host copy: off the CPU, reads answer from it, equal to the device table,
without a device-to-host sync (under the CUDA profile)."""

from __future__ import annotations

import torch

from sglang_like.mem_pool import ReqToTokenPool

from .cuda_profile import cuda_profile


def test_reads_come_from_the_host_copy_without_a_sync() -> None:
    with cuda_profile() as profile:
        pool = ReqToTokenPool(3, 16, "cuda")
        pool.write(1, 0, [5, 6, 7])
        pool.write(1, 5, [9])  # past the end written: the gap reads as the table's zeros
        pool.write_one(1, 3, 11)
        pool.write(2, 0, [1, 2, 3, 4])
        pool.write(2, 0, [8])  # a reused row: only what is written changes
        got = [pool.read(1, 0, 6), pool.read(2, 1, 4), pool.read(2, 0, 1)]
        assert profile.syncs == []
        with profile.uncounted():
            table = pool.req_to_token.cpu()
    assert got == [table[1, :6].tolist(), table[2, 1:4].tolist(), [8]]
    assert got[0] == [5, 6, 7, 11, 0, 9]


def test_on_cpu_the_table_is_read_directly() -> None:
    pool = ReqToTokenPool(2, 8, "cpu")
    pool.write(0, 0, [3, 4])
    pool.write_one(0, 2, 5)
    assert pool.read(0, 0, 3) == [3, 4, 5] == pool.req_to_token[0, :3].tolist()
    assert pool._host_rows is None and isinstance(pool.req_to_token, torch.Tensor)

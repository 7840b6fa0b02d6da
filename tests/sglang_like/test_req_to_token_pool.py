"""ReqToTokenPool off the CPU: reads answer from the host copy without a device-to-host sync,
and writes reach the device table in one copy when it is next asked for (under the CUDA
profile); on the CPU the table is written and read directly."""

from __future__ import annotations

from sglang_like.mem_pool import ReqToTokenPool

from .cuda_profile import cuda_profile


def test_reads_come_from_the_host_copy_and_writes_cross_at_once() -> None:
    with cuda_profile() as profile:
        pool = ReqToTokenPool(3, 16, "cuda")
        profile.reset()
        pool.write(1, 0, [5, 6, 7])
        pool.write(1, 5, [9])  # past the end written: the gap reads as the table's zeros
        pool.write_one(1, 3, 11)
        pool.write(2, 0, [1, 2, 3, 4])
        pool.write(2, 0, [8])  # written twice in a step: the later write wins
        got = [pool.read(1, 0, 6), pool.read(2, 0, 4)]
        assert profile.syncs == [] and profile.uploads == []
        table = pool.req_to_token
        assert profile.uploads == ["to"] and profile.syncs == []
        assert pool.req_to_token is table and profile.uploads == ["to"]  # nothing pending
        with profile.uncounted():
            table = table.cpu()
    assert got == [table[1, :6].tolist(), table[2, :4].tolist()]
    assert got == [[5, 6, 7, 11, 0, 9], [8, 2, 3, 4]]


def test_on_cpu_the_table_is_written_and_read_directly() -> None:
    pool = ReqToTokenPool(2, 8, "cpu")
    pool.write(0, 0, [3, 4])
    pool.write_one(0, 2, 5)
    assert pool.req_to_token[0, :3].tolist() == [3, 4, 5] == pool.read(0, 0, 3)
    assert pool._host_rows is None and pool._pending is None

"""Unit tests for KVSlotAllocator."""

import pytest

from radix_cache import KVSlotAllocator


def test_fresh_allocator_hands_out_ascending_slots_and_never_slot_zero() -> None:
    allocator = KVSlotAllocator(6)
    assert allocator.size == 6
    assert allocator.num_free_slots == 6
    assert allocator.alloc(4) == [1, 2, 3, 4]
    assert allocator.alloc(2) == [5, 6]
    assert allocator.num_free_slots == 0


@pytest.mark.parametrize(
    ("size", "first", "second", "expect_second"),
    [
        (5, 3, 3, None),  # not enough left: nothing taken
        (5, 3, 2, 2),
        (5, 0, 5, 5),
        (5, 5, 0, 0),
        (1, 1, 1, None),
    ],
)
def test_alloc_is_all_or_nothing(size: int, first: int, second: int, expect_second: int | None
                                 ) -> None:
    allocator = KVSlotAllocator(size)
    assert len(allocator.alloc(first) or []) == first
    got = allocator.alloc(second)
    if expect_second is None:
        assert got is None
        assert allocator.num_free_slots == size - first
    else:
        assert got is not None and len(got) == expect_second
        assert allocator.num_free_slots == size - first - second


def test_free_returns_slots_and_they_are_reused() -> None:
    allocator = KVSlotAllocator(4)
    slots = allocator.alloc(4)
    assert slots is not None
    allocator.free(slots[1:3])
    assert allocator.num_free_slots == 2
    assert [allocator.is_free(s) for s in range(0, 6)] == [False, False, True, True, False, False]
    assert sorted(allocator.alloc(2) or []) == [2, 3]


@pytest.mark.parametrize(
    "bad_free",
    [
        [0],  # reserved padding slot
        [5],  # past the end
        [-1],
        [1, 1],  # duplicate inside one call
        [2, 4],  # 4 is already free
    ],
)
def test_bad_free_is_assertion_error_and_changes_nothing(bad_free: list[int]) -> None:
    allocator = KVSlotAllocator(4)
    assert allocator.alloc(3) == [1, 2, 3]
    with pytest.raises(AssertionError):
        allocator.free(bad_free)
    assert allocator.num_free_slots == 1
    assert [allocator.is_free(s) for s in (1, 2, 3, 4)] == [False, False, False, True]


def test_reset_frees_everything() -> None:
    allocator = KVSlotAllocator(3)
    allocator.alloc(2)
    allocator.reset()
    assert allocator.num_free_slots == 3
    assert allocator.alloc(3) == [1, 2, 3]


@pytest.mark.parametrize("size", [0, -3])
def test_non_positive_size_is_value_error(size: int) -> None:
    with pytest.raises(ValueError):
        KVSlotAllocator(size)


def test_negative_alloc_is_value_error() -> None:
    with pytest.raises(ValueError):
        KVSlotAllocator(4).alloc(-1)


def test_high_water_is_the_highest_slot_ever_handed_out():
    from radix_cache import KVSlotAllocator

    a = KVSlotAllocator(10)
    assert a.high_water == 0
    first = a.alloc(3)
    assert first == [1, 2, 3] and a.high_water == 3
    a.free(first)
    a.alloc(2)  # freed slots are reused first: nothing new touched
    assert a.high_water == 3
    a.alloc(4)
    assert a.high_water == 6
    a.reset()
    assert a.high_water == 0

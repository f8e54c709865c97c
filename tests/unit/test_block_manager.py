"""Block manager: O(1) pages, all-or-nothing growth, no leak, no sharing, prefix hash hook."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sched.block_manager import BlockManager, OutOfPages, PageAllocator, PageError


def check_invariants(bm: BlockManager, alloc: PageAllocator) -> None:
    pages = [p for sid in bm.live_sequences() for p in bm.block_table(sid)]
    assert len(pages) == len(set(pages)), "a page is in two tables"
    assert bm.num_used_pages == len(pages)
    assert alloc.num_free + len(pages) == alloc.num_total, "a page leaked"
    assert all(0 <= p < alloc.num_total for p in pages)


def test_allocator_free_list_and_errors():
    a = PageAllocator(3)
    got = [a.allocate() for _ in range(3)]
    assert sorted(got) == [0, 1, 2] and a.num_free == 0
    with pytest.raises(OutOfPages):
        a.allocate()
    a.free(1)
    with pytest.raises(PageError):
        a.free(1)  # double free
    with pytest.raises(PageError):
        a.free(7)  # never ours
    assert a.allocate() == 1


def test_allocator_with_offset_ids():
    # A shared pool hands out global ids; nothing may assume ids start at 0.
    a = PageAllocator(4, first_id=100)
    bm = BlockManager(2, a)
    assert bm.ensure_capacity(1, 7)
    assert bm.block_table(1) == [100, 101, 102, 103]
    assert not bm.ensure_capacity(2, 1)
    assert bm.free(1) == 4 and a.num_free == 4


def test_ensure_capacity_is_all_or_nothing_and_tables_only_grow():
    a = PageAllocator(5)
    bm = BlockManager(4, a)
    assert bm.ensure_capacity(1, 5)  # 2 pages
    t = list(bm.block_table(1))
    assert bm.num_new_pages(1, 8) == 0 and bm.num_new_pages(1, 9) == 1
    assert bm.ensure_capacity(1, 9)
    assert bm.block_table(1)[:2] == t  # grows, never reorders
    assert not bm.ensure_capacity(2, 4 * 3)  # needs 3, only 2 free: nothing taken
    assert a.num_free == 2 and not bm.has(2)
    assert bm.ensure_capacity(2, 8)
    check_invariants(bm, a)
    assert bm.free(99) == 0  # unknown: no-op
    bm.free(1)
    bm.free(2)
    assert a.num_free == 5 and bm.num_used_pages == 0


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.integers(1, 8),
    num_pages=st.integers(1, 40),
    ops=st.lists(st.tuples(st.sampled_from(["grow", "free"]), st.integers(0, 6), st.integers(1, 40)), max_size=80),
)
def test_random_traces_never_leak_or_share(block_size, num_pages, ops):
    a = PageAllocator(num_pages)
    bm = BlockManager(block_size, a)
    lengths: dict[int, int] = {}
    for op, sid, n in ops:
        if op == "grow":
            want = lengths.get(sid, 0) + n
            free_before = a.num_free
            need = bm.num_new_pages(sid, want)
            ok = bm.ensure_capacity(sid, want)
            assert ok == (need <= free_before)
            if ok:
                lengths[sid] = want
                assert len(bm.block_table(sid)) * block_size >= want
            else:
                assert a.num_free == free_before
        else:
            bm.free(sid)
            lengths.pop(sid, None)
        check_invariants(bm, a)

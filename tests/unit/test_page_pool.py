"""PagePool: page geometry and strides, isolation of models with different token sizes, exclusive
ownership and no leaks over random traces, guaranteed minimums under a burst, caps, fencing and
resizing with live pages, and the block manager running on it."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sched.block_manager import BlockManager, OutOfPages, PageError
from engine.kv.layout import (
    ModelPageSource,
    PagePoolError,
    PageOwnershipError,
    PoolBusyError,
    PoolExhausted,
    kv_layout,
)
from engine.kv.page_pool import PagePool

# Model "big": 2 layers x 2 x 2 heads x 8 dims x fp16 = 128 B/token; "small": 1 x 2 x 1 x 4 x fp32.
BIG = dict(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16)
SMALL = dict(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)


def test_geometry_and_strides():
    pool = PagePool(6, 4096 + 64, device="cpu")  # 64 B of padding a page: views must not care
    lay = pool.register("big", **BIG)
    assert lay.bytes_per_token == 2 * 2 * 2 * 8 * 2 == 128
    assert lay.tokens_per_page == 32 and pool.allocator_for("big").block_size == 32
    views = pool.kv_views("big")
    assert len(views) == 2
    page_elems = (4096 + 64) // 2
    for k, v in views:
        assert k.shape == v.shape == (6, 32, 2, 8) and k.dtype == torch.float16
        assert k.stride() == v.stride() == (page_elems, 16, 8, 1)
    # Write one value through each view and find it at the byte offset of the page layout
    # [layers, 2, tokens, kv_heads, head_dim].
    raw = pool._memory.tensor
    for layer in range(2):
        for kind in range(2):
            view = views[layer][kind]
            page, tok, head, dim = 4, 17, 1, 5
            view[page, tok, head, dim] = 1.5
            elem = (((layer * 2 + kind) * 32 + tok) * 2 + head) * 8 + dim
            off = page * (4096 + 64) + elem * 2
            assert raw[page, elem * 2:elem * 2 + 2].view(torch.float16).item() == 1.5
            assert raw.view(-1)[off:off + 2].view(torch.float16).item() == 1.5
    assert int((raw != 0).sum()) <= 4 * 2  # nothing else was touched


def test_register_rejects_bad_geometry():
    pool = PagePool(4, 256, device=None)
    with pytest.raises(PagePoolError, match="needs 16384 B, more than a 256 B page"):
        pool.register("huge", num_layers=4, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    with pytest.raises(PagePoolError, match="do not fit a page"):
        pool.register("m", **BIG, tokens_per_page=3)  # 2 fit
    with pytest.raises(PagePoolError, match="unsupported KV dtype"):
        pool.register("m", num_layers=1, num_kv_heads=1, head_dim=4, dtype="complex64")
    with pytest.raises(PagePoolError, match="num_layers"):
        pool.register("m", num_layers=0, num_kv_heads=1, head_dim=4, dtype="float16")
    with pytest.raises(PagePoolError, match="max_pages 1 < min_pages 2"):
        pool.register("m", **SMALL, min_pages=2, max_pages=1)
    with pytest.raises(PagePoolError, match="multiple of 16"):
        PagePool(4, 100)
    assert pool.register("m", **SMALL, tokens_per_page=8).tokens_per_page == 8
    assert kv_layout(2 << 20, num_layers=32, num_kv_heads=8, head_dim=128,
                     dtype="bfloat16").tokens_per_page == 16  # Llama-3.1-8B: 128 KiB a token
    assert kv_layout(2 << 20, num_layers=24, num_kv_heads=2, head_dim=64,
                     dtype="bfloat16").tokens_per_page == 170  # a padded page
    with pytest.raises(PagePoolError, match="already registered"):
        pool.register("m", **SMALL)
    with pytest.raises(PagePoolError, match="no memory"):
        pool.kv_views("m")


def test_two_models_with_different_token_sizes_do_not_corrupt_each_other():
    gen = torch.Generator().manual_seed(0)
    pool = PagePool(16, 4096, device="cpu")
    pool.register("big", **BIG, min_pages=2)
    pool.register("small", **SMALL, min_pages=2)
    assert pool.layout("small").tokens_per_page == 4096 // 32
    big, small = pool.allocator_for("big"), pool.allocator_for("small")
    rng = random.Random(1)
    pages = {"big": [], "small": []}
    for _ in range(14):  # interleave, so the two models' pages alternate in the pool
        name = rng.choice(["big", "small"])
        pages[name].append((big if name == "big" else small).allocate())
    assert not set(pages["big"]) & set(pages["small"])
    written = {}
    for name in ("small", "big"):
        for layer, (k, v) in enumerate(pool.kv_views(name)):
            for kind, view in enumerate((k, v)):
                idx = torch.tensor(pages[name], dtype=torch.long)
                data = torch.randn((len(idx),) + tuple(view.shape[1:]), generator=gen).to(view.dtype)
                view[idx] = data
                written[name, layer, kind] = data
        if name == "small":
            small_bytes = pool._memory.tensor[torch.tensor(pages["small"])].clone()
    # The big model's writes left every byte of the small model's pages as it was ...
    assert torch.equal(pool._memory.tensor[torch.tensor(pages["small"])], small_bytes)
    # ... and each model reads back exactly what it wrote.
    for (name, layer, kind), data in written.items():
        view = pool.kv_views(name)[layer][kind]
        assert torch.equal(view[torch.tensor(pages[name])], data)


def check_state(pool: PagePool, held: dict[str, set[int]]) -> None:
    pool.audit()
    seen: set[int] = set()
    for name, pages in held.items():
        assert not pages & seen, "a page has two owners"
        seen |= pages
        src = pool.allocator_for(name)
        assert src.num_used == len(pages)
        s = pool.stats()[name]
        # Whatever the others did, a model can still reach its guaranteed minimum.
        assert src.num_free >= s["min"] - len(pages)
        if s["max"] >= 0:
            assert len(pages) <= s["max"]
    assert all(0 <= p < pool.num_pages for p in seen)
    assert pool.num_free <= pool.num_pages - len(seen)  # equal when nothing is fenced


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]),
                          st.sampled_from(["alloc", "alloc", "free", "fence", "resize"]),
                          st.integers(0, 1000)), max_size=300))
def test_random_traces_keep_ownership_minimums_and_free_everything(ops):
    pool = PagePool(24, 1024, device=None)
    pool.register("a", **SMALL, min_pages=4)
    pool.register("b", **SMALL, min_pages=6, max_pages=10)
    pool.register("c", **SMALL)
    held = {n: set() for n in "abc"}
    for name, action, pick in ops:
        src = pool.allocator_for(name)
        if action == "alloc" or (action == "free" and not held[name]):
            expect = src.num_free
            page = src.try_allocate()
            assert (page is None) == (expect == 0)
            if page is not None:
                assert pool.num_pages > page and all(page not in h for h in held.values())
                held[name].add(page)
        elif action == "free":
            page = sorted(held[name])[pick % len(held[name])]
            src.free(page)
            held[name].discard(page)
        elif action == "fence":
            try:
                pool.fence(pick % (pool.num_pages + 1))
            except PoolExhausted:
                pass
        else:
            try:
                pool.resize(pick % 40)
            except (PoolBusyError, PoolExhausted):
                pass
        check_state(pool, held)
    for name in "abc":
        assert pool.free_all(name) == len(held[name])
        pool.unregister(name)
    pool.fence(pool.num_pages)  # lift any fence
    assert pool.num_free == pool.num_pages and pool.num_reserved == 0
    pool.audit()


def test_burst_cannot_lock_another_model_out():
    pool = PagePool(20, 1024, device=None)
    pool.register("flood", **SMALL, min_pages=2)
    pool.register("quiet", **SMALL, min_pages=5)
    flood = pool.allocator_for("flood")
    got = []
    while (p := flood.try_allocate()) is not None:
        got.append(p)
    assert len(got) == 15 and pool.num_free == 5 and flood.num_free == 0
    with pytest.raises(OutOfPages):
        flood.allocate()
    quiet = pool.allocator_for("quiet")
    assert quiet.can_allocate(5) and not quiet.can_allocate(6)
    mine = [quiet.allocate() for _ in range(5)]
    assert quiet.try_allocate() is None and not set(mine) & set(got)
    flood.free(got.pop())  # above their minimums, pages go to whoever asks first
    assert quiet.num_free == 1 and flood.num_free == 1
    assert quiet.allocate() not in got


def test_cap_and_minimum_admission():
    pool = PagePool(10, 1024, device=None)
    pool.register("a", **SMALL, min_pages=6)
    with pytest.raises(PoolExhausted, match="cannot guarantee 5 pages to 'b': 4 free"):
        pool.register("b", **SMALL, min_pages=5)
    pool.register("b", **SMALL, min_pages=1, max_pages=3)
    b = pool.allocator_for("b")
    assert b.num_free == 3 and b.num_total == 3
    for _ in range(3):
        b.allocate()
    assert b.try_allocate() is None and b.num_total == 3
    assert pool.allocator_for("a").num_free == 7  # its 6 held back + the 1 nobody holds


def test_ownership_errors():
    pool = PagePool(4, 1024, device=None)
    pool.register("a", **SMALL)
    pool.register("b", **SMALL)
    a, b = pool.allocator_for("a"), pool.allocator_for("b")
    page = a.allocate()
    with pytest.raises(PageOwnershipError, match="'b' frees page 0, held by 'a'"):
        b.free(page)
    a.free(page)
    with pytest.raises(PageError, match="double free"):  # the block manager's error type too
        a.free(page)
    for bad in (-1, 4, True, "0"):
        with pytest.raises(PagePoolError, match="not a page id"):
            a.free(bad)
    a.allocate()
    with pytest.raises(PoolBusyError, match="still holds 1 pages"):
        pool.unregister("a")
    pool.free_all("a")
    pool.unregister("a")
    with pytest.raises(PagePoolError, match="no longer registered"):
        a.allocate()
    pool.register("a", **SMALL)  # a new registration does not revive the old allocator
    with pytest.raises(PagePoolError, match="no longer registered"):
        a.num_free
    pool.audit()


def test_fence_and_resize_keep_live_pages():
    pool = PagePool(8, 1024, device="cpu")
    pool.register("a", **SMALL, min_pages=2)
    a = pool.allocator_for("a")
    pages = [a.allocate() for _ in range(8)]
    k = pool.kv_views("a")[0][0]
    for p in pages:
        k[p].fill_(float(p))
    del k
    with pytest.raises(PoolBusyError, match="4 pages above are still held"):
        pool.resize(4)
    assert pool.fence(4) == 4
    for p in (1, 6, 7, 5):
        a.free(p)
    assert pool.num_free == 1 and a.try_allocate() == 1  # only pages below the fence come back
    assert pool.num_fenced_in_use() == 1
    a.free(4)
    pool.resize(4)
    assert pool.num_pages == 4 and pool.generation == 1 and pool.nbytes == 4096
    k = pool.kv_views("a")[0][0]
    for p in (0, 1, 2, 3):
        assert torch.all(k[p] == float(p))
    del k
    pool.audit()
    pool.resize(10)  # grow: live pages kept, new ones free
    assert pool.num_free == 6 and pool.num_pages == 10
    assert torch.all(pool.kv_views("a")[0][0][3] == 3.0)
    pool.audit()


def test_resize_refuses_while_views_are_held_and_changes_nothing():
    pool = PagePool(4, 1024, device="cpu")
    pool.register("a", **SMALL)
    page = pool.allocator_for("a").allocate()
    k = pool.kv_views("a")[0][0]
    k[page].fill_(7.0)
    with pytest.raises(PoolBusyError, match="still referenced"):
        pool.resize(8)
    assert pool.num_pages == 4 and pool.generation == 0
    fresh = pool.kv_views("a")[0][0]
    fresh[page].fill_(9.0)
    assert torch.all(k[page] == 9.0)  # still the same memory
    del k, fresh
    pool.resize(8)
    assert torch.all(pool.kv_views("a")[0][0][page] == 9.0)


def test_failed_allocation_during_resize_keeps_the_old_pool(monkeypatch):
    from engine.kv.page_memory import PoolMemory

    pool = PagePool(4, 1024, device="cpu")
    pool.register("a", **SMALL)
    page = pool.allocator_for("a").allocate()
    pool.kv_views("a")[0][0][page].fill_(4.0)
    real = PoolMemory._zeros

    def short_of_memory(self, num_pages):
        if num_pages == 100:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(self, num_pages)

    monkeypatch.setattr(PoolMemory, "_zeros", short_of_memory)
    with pytest.raises(PagePoolError, match="could not allocate 100 pages.*keeps its 4 pages"):
        pool.resize(100)
    assert pool.num_pages == 4 and pool.generation == 0 and pool.num_used("a") == 1
    assert torch.all(pool.kv_views("a")[0][0][page] == 4.0)
    pool.audit()


def test_resize_and_fence_respect_minimums():
    pool = PagePool(8, 1024, device=None)
    pool.register("a", **SMALL, min_pages=3)
    pool.register("b", **SMALL, min_pages=3)
    with pytest.raises(PoolExhausted, match="guaranteed"):
        pool.fence(5)
    with pytest.raises(PoolExhausted, match="guaranteed"):
        pool.resize(5)
    pool.resize(6)
    assert pool.num_free == 6 and pool.num_reserved == 6


def test_block_manager_runs_on_the_pool():
    pool = PagePool(6, 1024, device=None)
    pool.register("a", **SMALL, min_pages=2)
    pool.register("b", **SMALL, min_pages=2)
    src = pool.allocator_for("a")
    assert isinstance(src, ModelPageSource)
    bm = BlockManager(src.block_size, src)
    bs = src.block_size
    assert bm.num_free_pages == 4 and bm.num_total_pages == 4
    assert bm.ensure_capacity(1, 3 * bs) and bm.num_used_pages == 3
    assert not bm.ensure_capacity(2, 2 * bs)  # b's two held-back pages are not a's
    assert bm.ensure_capacity(2, bs)
    assert pool.num_used("a") == 4 and pool.allocator_for("b").num_free == 2
    assert bm.free(1) == 3 and bm.free(2) == 1
    assert pool.num_free == 6
    pool.audit()


def test_flat_buffer_matches_the_engine_kv_cache_layout():
    from engine.kv.kv_cache import KVCache, KVSpec

    pool = PagePool(5, 4096, device="cpu")
    lay = pool.register("big", **BIG)
    spec = KVSpec(lay.num_layers, lay.tokens_per_page, lay.num_kv_heads, lay.head_dim, torch.float16)
    kv = KVCache.from_buffer(spec, pool.flat_buffer("big"))
    assert kv.num_pages == 5
    for layer, (k, v) in enumerate(pool.kv_views("big")):
        assert kv.k(layer).data_ptr() == k.data_ptr() and kv.k(layer).stride() == k.stride()
        assert kv.v(layer).data_ptr() == v.data_ptr() and kv.v(layer).stride() == v.stride()
    padded = PagePool(5, 4096 + 16, device="cpu")
    padded.register("big", **BIG)
    with pytest.raises(PagePoolError, match="use kv_views"):
        padded.flat_buffer("big")


def test_import_stays_torch_free():
    code = "import sys, engine.kv.page_pool; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- prefix caching: cached-free pages ----------------------------------------------------------


def _caching_pool(num_pages=6, device=None):
    pool = PagePool(num_pages, 1024, device=device)
    for m in ("a", "b"):
        pool.register(m, **SMALL)
    evicted: dict[str, list[int]] = {"a": [], "b": []}
    allocs = {}
    for m in ("a", "b"):
        allocs[m] = pool.allocator_for(m)
        allocs[m].on_evict = evicted[m].append
    return pool, allocs["a"], allocs["b"], evicted


def test_cached_free_pages_are_free_for_everyone_and_go_last_least_recent_first():
    pool, a, b, evicted = _caching_pool()
    held = [a.allocate() for _ in range(4)]
    a.free_cached(held[2])
    a.free_cached(held[0])
    a.free(held[1])
    assert pool.num_free == 5 and pool.num_cached_free == 2 and b.num_free == 5 and a.num_free == 5
    got = [b.allocate() for _ in range(4)]  # the 3 plain free ones, then the least recently freed cached-free one
    assert set(got[:3]) == set(range(6)) - {held[0], held[2], held[3]} and got[3] == held[2]
    assert evicted == {"a": [held[2]], "b": []}
    assert not a.take_cached(held[2])  # handed out: no longer a's to take back
    assert a.take_cached(held[0]) and pool.num_cached_free == 0 and pool.num_used("a") == 2
    pool.audit()


def test_take_cached_respects_caps_and_other_models_minimums():
    pool = PagePool(4, 1024)
    pool.register("a", **SMALL, max_pages=1)
    a = pool.allocator_for("a")
    p = a.allocate()
    a.free_cached(p)
    q = a.allocate()  # a plain free page: the cached-free one is handed out last
    assert q != p and not a.take_cached(p)  # a is at its cap
    a.free(q)
    assert a.take_cached(p)
    pool = PagePool(3, 1024)
    pool.register("c", **SMALL)
    pool.register("b", **SMALL, min_pages=2)
    c = pool.allocator_for("c")
    y = c.allocate()
    c.free_cached(y)
    z = c.allocate()  # plain; now 2 free pages (one is y) and both are held back for b
    assert z != y and not c.take_cached(y)
    b = pool.allocator_for("b")
    taken = [b.allocate() for _ in range(2)]
    assert y in taken  # b's guaranteed pages may be the cached-free one
    pool.audit()


def test_fence_and_resize_evict_the_cached_free_pages_they_cut_and_keep_the_rest():
    pool, a, b, evicted = _caching_pool(8, device="cpu")
    pages = [a.allocate() for _ in range(8)]
    k = pool.kv_views("a")[0][0]
    for p in pages:
        k[p].fill_(float(p))
    del k
    for p in (1, 6):
        a.free_cached(p)
    assert pool.fence(4) == 3  # pages 4, 5, 7 held above it; 6, cached-free above it, is evicted
    assert evicted["a"] == [6]
    a.free_cached(5)  # freed cached above the fence: it drains, out of the index at once
    assert evicted["a"] == [6, 5] and 5 not in pool.cached_free_pages()
    for p in (4, 7):
        a.free(p)
    pool.resize(4)
    assert pool.cached_free_pages("a") == [1] and pool.num_free == 1
    assert torch.all(pool.kv_views("a")[0][0][1] == 1.0)  # a cached-free page keeps its K/V across a resize
    assert a.take_cached(1)
    pool.audit()


def test_unregistering_frees_a_models_cached_free_pages():
    pool, a, b, evicted = _caching_pool()
    p = a.allocate()
    a.free_cached(p)
    pool.free_all("a")
    pool.unregister("a")
    assert pool.num_cached_free == 0 and pool.num_free == 6 and evicted["a"] == []
    pool.audit()


def test_the_lowest_free_page_goes_first_so_live_pages_gather_at_the_bottom():
    """A shrink needs its tail free (on a GPU the tail is unmapped in place): pages are handed
    out lowest id first whatever order they were freed in, and the pool names who holds the tail."""
    pool = PagePool(16, 1024, device=None)
    pool.register("a", **BIG)
    pool.register("b", **BIG)
    a, b = pool.allocator_for("a"), pool.allocator_for("b")
    held = [a.allocate() for _ in range(6)] + [b.allocate() for _ in range(4)]
    assert held == list(range(10))
    for p in (7, 2, 9, 4):  # freed out of order, by both models
        (b if p >= 6 else a).free(p)
    assert [a.allocate() for _ in range(3)] == [2, 4, 7]
    assert pool.holders_at_or_above(8) == {"b"} and pool.holders_at_or_above(6) == {"a", "b"}
    assert pool.holders_at_or_above(10) == set()
    pool.resize(10)  # the tail is free: the pool shrinks with every live page kept
    assert pool.num_pages == 10 and pool.num_free == 1
    assert pool.memory_moves  # accounting only (device None): nothing stays put
    pool.audit()


def test_a_page_freed_while_its_models_step_is_on_the_device_goes_to_no_other_model_until_it_is_done():
    # A's step N+1 is on the device (launched behind N) when N's collect ends a sequence: its
    # pages are freed, but N+1 still writes its row's K/V into the last of them. B's step may run
    # beside it (the urgent stream): B must not get those pages until A's steps there are done.
    pool = PagePool(4, 4096, device=None)
    pool.register("a", **BIG)
    pool.register("b", **SMALL)
    a, b = pool.allocator_for("a"), pool.allocator_for("b")
    pages = [a.allocate() for _ in range(3)]
    a.step_launched()
    a.free(pages[0])
    a.free_cached(pages[1])  # a prefix-indexed page, freed cached
    assert a.num_held == 2 and a.num_used == 3  # still A's: owned, counted, under its cap
    assert b.num_free == 1 and b.allocate() == 3 and b.try_allocate() is None
    with pytest.raises(PageOwnershipError, match="twice"):
        a.free(pages[0])
    assert a.take_cached(pages[1])  # A's own prefix hit: its steps are ordered after N+1
    a.step_launched()  # N+2, launched before N+1 is collected
    a.step_done()  # N+1 done: what was freed behind it goes, though N+2 is on the device
    assert a.num_held == 0 and a.num_used == 2 and b.allocate() == pages[0]
    a.free(pages[2])  # behind N+2
    assert a.num_held == 1 and b.try_allocate() is None
    a.step_launched()  # N+3: A launches step behind step and always has one on the device
    a.step_done()  # N+2 done
    assert a.num_held == 0 and b.allocate() == pages[2]
    a.step_done()
    with pytest.raises(PagePoolError, match="no step on the device"):
        a.step_done()


def test_alone_in_the_pool_a_model_frees_at_once_and_free_all_takes_the_held_pages_too():
    pool = PagePool(4, 4096, device=None)
    pool.register("a", **BIG)
    a = pool.allocator_for("a")
    p = a.allocate()
    a.step_launched()
    a.free(p)  # no other model to take it: its own later steps run after the one in flight
    assert a.num_held == 0 and a.num_used == 0
    q = a.allocate()
    pool.register("b", **SMALL)
    a.free(q)
    assert a.num_held == 1
    assert pool.free_all("a") == 1  # an unload: no step of it is on the device any more
    assert a.num_held == 0 and a.num_used == 0
    pool.unregister("a")


def test_a_model_takes_back_its_own_held_pages_when_nothing_else_is_free():
    # Under page pressure the model whose pages are held reuses them (its next step runs after
    # the one that may still write them): a page short must not preempt its whole batch.
    pool = PagePool(3, 4096, device=None)
    pool.register("a", **BIG)
    pool.register("b", **SMALL)
    a, b = pool.allocator_for("a"), pool.allocator_for("b")
    evicted = []
    a.on_evict = evicted.append
    p, q, r = a.allocate(), a.allocate(), a.allocate()
    a.step_launched()
    a.free(p)
    a.free_cached(q)
    assert a.num_free == 2 and b.num_free == 0 and b.try_allocate() is None
    assert {a.allocate(), a.allocate()} == {p, q} and evicted == [q]  # the cached one leaves its index
    assert a.num_held == 0 and a.num_used == 3 and a.try_allocate() is None
    pool.audit()
    a.step_done()
    a.free(r)  # nothing of a's on the device: at once
    assert b.allocate() == r
    pool.audit()


def _capped_beside_another(max_pages: int) -> tuple[PagePool, object]:
    """A pool of 6 pages shared by "a" (capped at ``max_pages``) and "b"; a's allocator."""
    pool = PagePool(6, 4096, device=None)
    pool.register("a", **BIG, max_pages=max_pages)
    pool.register("b", **SMALL)
    return pool, pool.allocator_for("a")


def test_held_pages_under_a_fence_and_a_cap_keep_the_books():
    # A held cached page above a fence leaves the model's index at once, as a free there would,
    # and drains when its step is done; a held page is counted once in the model's total.
    pool, a = _capped_beside_another(4)
    evicted = []
    a.on_evict = evicted.append
    pages = [a.allocate() for _ in range(4)]
    assert a.num_total == 4
    a.step_launched()
    a.free_cached(pages[3])
    a.free(pages[2])
    assert a.num_total == 4 and a.num_free == 2  # its two held pages, under its cap
    assert pool.fence(3) == 1  # page 3 is above: held, still in use
    assert evicted == [3] and not a.take_cached(3)
    assert a.num_free == 1  # page 2 only (page 3 drains)
    pool.audit()
    a.step_done()
    assert pool.num_fenced_in_use() == 0 and a.num_used == 2
    pool.resize(3)
    pool.audit()


def test_a_held_page_is_no_room_for_a_prefix_hit_past_the_cap():
    # Its held pages let a model reuse them, not grow: a prefix hit on a cached-free page still
    # needs room under its cap.
    pool, a = _capped_beside_another(2)
    p, q = a.allocate(), a.allocate()
    a.free_cached(q)  # nothing on the device: cached-free at once
    r = a.allocate()
    a.step_launched()
    a.free(p)
    assert a.num_free == 1 and not a.take_cached(q) and a.num_used == 2
    assert a.allocate() == p and a.try_allocate() is None
    assert r != q  # a cached-free page goes after the plain free ones
    pool.audit()

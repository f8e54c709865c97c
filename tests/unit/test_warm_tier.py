"""engine.weights.warm_tier on CPU: byte-exact round trips, LRU eviction under the budget, refusals."""

from __future__ import annotations

import pytest
import torch

from engine.stats import WarmTierStats
from engine.weights.warm_tier import WarmTier, WarmTierError


def model(seed, n=1000):
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(n, 8, generator=g).bfloat16(), "norm": torch.randn(8, generator=g),
            "qkv": torch.randn(24, 8, generator=g).half()[:, :5]}  # non-contiguous source


def nbytes(m):
    return sum((t.numel() * t.element_size() + 255) // 256 * 256 for t in m.values())


def test_round_trip_and_restore_into_new_tensors():
    tier = WarmTier(10 << 20, pin=False)
    m = model(1)
    assert tier.put("a", m)
    got = tier.get("a")
    assert set(got) == set(m) and all(torch.equal(got[k], m[k]) for k in m)
    dst = {k: torch.full(t.shape, float("nan"), dtype=t.dtype) for k, t in m.items()}
    assert tier.restore("a", dst)
    assert all(torch.equal(dst[k], m[k]) for k in m)
    assert tier.used_bytes == nbytes(m)
    assert not tier.restore("nope", dst)


def test_lru_eviction_under_budget():
    m = model(2)
    tier = WarmTier(2 * nbytes(m) + 100, pin=False)
    assert tier.put("a", m) and tier.put("b", model(3))
    assert tier.get("a") is not None  # a becomes most recently used
    assert tier.put("c", model(4))  # evicts b, the least recently used
    assert tier.models() == ["a", "c"]
    assert tier.used_bytes <= tier.budget_bytes
    assert torch.equal(tier.get("a")["embed"], m["embed"])


def test_too_big_is_refused_without_evicting():
    m = model(5)
    tier = WarmTier(nbytes(m), pin=False)
    assert tier.put("a", m)
    assert not tier.put("huge", model(6, n=5000))
    assert tier.models() == ["a"]


def test_replace_same_name_and_discard():
    tier = WarmTier(10 << 20, pin=False)
    tier.put("a", model(7))
    m2 = model(8)
    tier.put("a", m2)
    assert tier.models() == ["a"] and torch.equal(tier.get("a")["norm"], m2["norm"])
    assert tier.discard("a") and not tier.discard("a") and tier.used_bytes == 0


def test_restore_mismatch_raises():
    tier = WarmTier(10 << 20, pin=False)
    m = model(9)
    tier.put("a", m)
    bad = {k: torch.empty(t.shape, dtype=t.dtype) for k, t in m.items()}
    bad["norm"] = torch.empty(9)
    with pytest.raises(WarmTierError):
        tier.restore("a", bad)
    with pytest.raises(WarmTierError):
        tier.restore("a", {"embed": bad["embed"]})
    with pytest.raises(WarmTierError):
        WarmTier(-1)


def test_arena_pinned_at_start_serves_every_put_and_coalesces_back():
    m = model(5)
    tier = WarmTier(3 * nbytes(m), pin=False)
    tier.prepin_async().join()
    assert tier._arena is not None and tier._arena.free == [(0, 3 * nbytes(m))]
    for i, name in enumerate("abc"):
        assert tier.put(name, model(10 + i))
    assert tier._arena.free == []  # three entries fill it exactly
    assert tier.put("d", model(13))  # evicts a (LRU) and takes its range
    assert tier.models() == ["b", "c", "d"]
    for i, name in enumerate("bcd", start=1):
        want = model(10 + i)
        dst = {k: torch.zeros(t.shape, dtype=t.dtype) for k, t in want.items()}
        assert tier.restore(name, dst) and all(torch.equal(dst[k], want[k]) for k in want)
    assert tier.put("c", model(99))  # a replacement frees the old range first
    assert all(torch.equal(tier.get("c")[k], model(99)[k]) for k in m)
    for name in tier.models():
        assert tier.discard(name)
    assert tier._arena.free == [(0, 3 * nbytes(m))] and tier.used_bytes == 0


def test_arena_range_of_an_entry_being_restored_is_not_reused_until_it_ends():
    m = model(6)
    tier = WarmTier(2 * nbytes(m), pin=False)
    tier.prepin()
    assert tier.put("a", m) and tier.put("b", model(7))
    a = tier._entries["a"]
    a.users = 1  # a restore of a is in progress
    assert tier.discard("a") and tier.models() == ["b"]
    assert tier.put("c", model(8))  # evicts b and takes its range: a's is still being read
    assert tier.models() == ["c"] and tier._arena.free == []
    with tier._lock:  # the restore ends (what restore() does in its finally)
        a.users -= 1
        tier._release(a)
    assert tier._arena.free == [(0, nbytes(m))]
    assert tier.put("d", model(9)) and tier.models() == ["c", "d"]
    assert all(torch.equal(tier.get("c")[k], model(8)[k]) for k in m)


class _Landing:
    """Stands for the CUDA event of a device put's copies (put_async) on this CPU box."""

    def __init__(self) -> None:
        self.done, self.waits = False, 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waits += 1
        self.done = True


def _in_flight(tier: WarmTier, name: str) -> _Landing:
    """Leave ``name`` as put_async leaves a device put: held by the put until its event lands."""
    ev = _Landing()
    with tier._lock:
        e = tier._entries[name]
        e.users += 1
        e.landing = ev
        tier._landing.append(e)
    return ev


def test_an_entry_whose_copies_are_in_flight_is_held_until_they_land():
    """Until a device put's copies land the entry is neither read (get: None) nor evicted, its
    range stays taken even once dropped, a restore waits for the landing, and a put that finds
    no room without it waits for the landing and tries again (else refused: the entry neither
    evictable nor its range free), one that does goes on at once."""
    m = model(6)
    tier = WarmTier(2 * nbytes(m), pin=False)
    tier.prepin()
    assert tier.put("a", m) and tier.put("b", model(7))
    ev = _in_flight(tier, "a")
    assert tier.get("a") is None and tier._entries["a"].users == 1
    dst = {k: torch.zeros(t.shape, dtype=t.dtype) for k, t in m.items()}
    assert tier.restore("a", dst) and ev.waits == 1  # a host destination waits for the landing
    assert all(torch.equal(dst[k], m[k]) for k in m)
    assert tier.get("a") is not None and tier._landing == []  # landed: the put's hold is gone
    ev = _in_flight(tier, "a")
    assert tier.discard("a") and tier._arena.free == []  # dropped, its range still being written
    ev.done = True
    assert tier.put("c", model(8)) and tier._arena.free == [] and tier.models() == ["b", "c"]
    ev2 = _in_flight(tier, "b")
    assert tier.put("d", model(9)) and ev2.waits == 0  # room without b's range: no wait, c goes
    assert tier.models() == ["b", "d"]
    ev3 = _in_flight(tier, "d")
    assert tier.put("e", model(10)) and ev2.waits == 1 and ev3.waits == 1  # none: waited, then b went
    assert tier.models() == ["d", "e"] and tier._landing == []


def test_an_entry_being_restored_is_kept_and_restored_again_without_a_copy():
    """An unload while a restore of the same entry reads it keeps the entry as it is (no second
    copy on the unload's path), and a second restore reads it beside the first."""
    m = model(6)
    tier = WarmTier(2 * nbytes(m), pin=False)
    tier.prepin()
    assert tier.put("k", m) and tier.put("other", model(7))
    e = tier._entries["k"]
    e.users = 1  # a restore of k is in progress
    assert tier.keep("k", m) and tier._entries["k"] is e  # the same bytes, not a new copy
    assert tier.models() == ["other", "k"]  # most recently used
    assert not tier.keep("k", {**m, "extra": torch.zeros(2)})  # another layout is not these bytes
    dst = {k: torch.zeros(t.shape, dtype=t.dtype) for k, t in m.items()}
    assert tier.restore("k", dst) and all(torch.equal(dst[k], m[k]) for k in m)
    assert e.users == 1  # the second restore let go; the first still holds it


def test_arena_take_and_give_coalesce():
    from engine.weights.warm_tier import _Arena

    a = _Arena(torch.empty(1000, dtype=torch.uint8))
    offs = [a.take(100) for _ in range(5)]
    assert offs == [0, 100, 200, 300, 400] and a.free == [(500, 500)]
    a.give(100, 100)
    a.give(300, 100)
    assert a.free == [(100, 100), (300, 100), (500, 500)]
    assert a.take(150) == 500  # first fit that is large enough
    a.give(200, 100)  # joins 100..200 and 300..400
    assert a.free == [(100, 300), (650, 350)]
    assert a.take(1000) is None


def test_the_arena_is_pinned_in_pieces_each_after_its_turn_and_copies_never_cross_a_piece():
    m = model(11)  # embed is 16,000 bytes: with 4 KiB pieces it spans four or five of them
    tier = WarmTier(3 * nbytes(m), pin=False, pin_chunk_bytes=4096)
    turns = []
    tier.prepin_async(lambda: turns.append(1)).join()
    arena = tier._arena
    base = arena.buf.data_ptr()
    assert arena.cuts and all((base + c) % 4096 == 0 for c in arena.cuts)  # at page-aligned addresses
    assert len(turns) == len(arena.cuts) + 1  # asked before every piece
    # A range is split exactly at the cuts inside it, and nowhere else.
    for off, n in ((0, arena.buf.numel()), (arena.cuts[0] - 10, 20), (arena.cuts[0], 4096), (5, 7)):
        pieces = arena.pieces(off, n)
        assert pieces[0][0] == 0 and pieces[-1][1] == n
        assert all(a < b for a, b in pieces) and all(p[1] == q[0] for p, q in zip(pieces, pieces[1:]))
        assert [off + b for _, b in pieces[:-1]] == [c for c in arena.cuts if off < c < off + n]
    for i, name in enumerate("abc"):  # byte-exact through the split copies, both ways
        assert tier.put(name, model(20 + i))
    for i, name in enumerate("abc"):
        want = model(20 + i)
        dst = {k: torch.zeros(t.shape, dtype=t.dtype) for k, t in want.items()}
        assert tier.restore(name, dst) and all(torch.equal(dst[k], want[k]) for k in want)


def test_pin_chunk_must_be_whole_pages():
    with pytest.raises(WarmTierError):
        WarmTier(1 << 20, pin=False, pin_chunk_bytes=1000)


def test_a_put_never_page_locks_nor_stores_pageable_only_the_start_up_pinning_locks(monkeypatch):
    """An unload's stash must not pay for page-locking (seconds per 8B), nor copy into pageable
    memory (15 s for an 8B on the H200, every model's step waiting): before any of the arena is
    pinned a put stores nothing; the registrations all happen in prepin, piece by piece."""
    calls = []

    class Driver:
        def cudaHostRegister(self, ptr, n, flags):
            calls.append(("register", n))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", 0))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Driver())
    m = model(3)
    tier = WarmTier(2 * nbytes(m), pin=True, pin_chunk_bytes=4096)
    assert not tier.put("a", m) and calls == [] and tier.models() == []  # no arena yet: nothing stored
    tier.prepin()
    assert calls and all(c == "register" for c, _ in calls)
    assert sum(n for _, n in calls) == 2 * nbytes(m)  # the whole budget, once
    n = len(calls)
    assert tier.put("b", model(4)) and len(calls) == n  # puts take arena ranges: no more calls
    dst = {k: torch.zeros(t.shape, dtype=t.dtype) for k, t in m.items()}
    assert tier.restore("b", dst) and all(torch.equal(dst[k], model(4)[k]) for k in m)


def test_puts_are_served_from_the_pinned_prefix_while_the_pinning_goes_on(monkeypatch):
    """The first pinned pieces serve the first unloads: a put fits once the page-locked prefix
    holds it, not once the whole budget is pinned; a put larger than that prefix stores nothing
    and evicts nothing."""
    monkeypatch.setattr(torch.cuda, "cudart", lambda: type("D", (), {
        "cudaHostRegister": lambda self, p, n, f: 0, "cudaHostUnregister": lambda self, p: 0})())
    m = model(7)
    tier = WarmTier(4 * nbytes(m), pin=True, pin_chunk_bytes=4096)
    pieces_for_one = -(-nbytes(m) // 4096) + 1  # its bytes, whatever the buffer's alignment
    seen = []

    def turn():  # before each piece: try a put, as an unload beside the pinning would
        done = len(seen)
        ok = tier.put(f"m{done}", model(done))
        seen.append((tier._arena.limit, ok))

    tier.prepin(turn)
    first_ok = next(i for i, (_, ok) in enumerate(seen) if ok)
    assert all(limit < nbytes(m) for limit, ok in seen[:first_ok])  # refused while too little was pinned
    assert first_ok <= pieces_for_one and seen[first_ok][0] >= nbytes(m)
    kept = tier.models()
    assert kept and all(tier._entries[k].arena_off + nbytes(m) <= tier._arena.limit for k in kept)
    for k in kept:
        want = model(int(k[1:]))
        dst = {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in want.items()}
        assert tier.restore(k, dst) and all(torch.equal(dst[n], want[n]) for n in want)


def test_a_failed_registration_leaves_nothing_pinned_and_the_tier_stores_nothing(monkeypatch):
    calls = []

    class Driver:
        def cudaHostRegister(self, ptr, n, flags):
            calls.append("register")
            return 0 if len(calls) < 3 else 2  # the third piece: out of lockable memory

        def cudaHostUnregister(self, ptr):
            calls.append("unregister")
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Driver())
    m = model(2)
    tier = WarmTier(4 * nbytes(m), pin=True, pin_chunk_bytes=4096)
    tier.prepin()
    assert calls.count("unregister") == 2  # the two that were registered, undone
    assert tier._arena.limit == 0 and not tier.put("a", m)


def test_stats_show_the_pinned_share_grow_to_the_budget_and_what_is_stored(monkeypatch):
    """What an operator (and the density bench, before a warm window) reads: ``ready`` is 0 before
    the start-up pinning, grows a piece at a time to the budget, and drops to 0 again when a
    registration fails; without pinning the whole budget is ready at once."""
    calls, fail_at = [], []

    def register(self, p, n, f):  # the fail_at-th registration fails (out of lockable memory)
        calls.append(n)
        return 2 if fail_at and len(calls) == fail_at[0] else 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: type("D", (), {
        "cudaHostRegister": register, "cudaHostUnregister": lambda self, p: 0})())
    m = model(5)
    budget = 3 * nbytes(m)
    tier = WarmTier(budget, pin=True, pin_chunk_bytes=4096)
    assert tier.stats() == WarmTierStats(budget=budget, ready=0, used=0, models=0)
    seen = []
    tier.prepin(lambda: seen.append(tier.stats().ready))
    assert seen[0] == 0 and seen == sorted(seen) and len(set(seen)) == len(seen) > 2  # one piece a turn
    assert tier.put("a", m) and tier.stats() == WarmTierStats(budget=budget, ready=budget, used=nbytes(m), models=1)

    calls.clear()
    fail_at.append(3)
    broken = WarmTier(budget, pin=True, pin_chunk_bytes=4096)
    grew = []
    broken.prepin(lambda: grew.append(broken.stats().ready))
    assert grew[:3] == sorted(grew[:3]) and grew[2] > 0  # two pieces were ready ...
    assert broken.stats().ready == 0  # ... and none is once the third failed (all undone)

    plain = WarmTier(budget, pin=False)
    assert plain.stats() == WarmTierStats(budget=budget, ready=budget, used=0, models=0)
    assert plain.put("b", m) and plain.stats().used == nbytes(m)

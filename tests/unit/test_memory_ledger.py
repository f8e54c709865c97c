"""MemoryLedger arithmetic: budget resolution, load plans with LRU eviction, refusals that carry
their numbers, bookings back to zero, and the allocator cross-check."""

from __future__ import annotations

import threading

import pytest

from engine.errors import EngineError
from engine.core.ledger import (
    STEPS_IN_FLIGHT,
    GiB,
    LedgerError,
    LoadRefused,
    MemoryLedger,
    format_bytes,
    resolve_budget,
)

MiB = 1024**2


def test_budget_from_bytes_or_fraction():
    assert resolve_budget(8 * GiB, device_total=None) == 8 * GiB
    assert resolve_budget(0.5, device_total=80 * GiB) == 40 * GiB
    assert resolve_budget(1.0, device_total=80 * GiB, device_free=80 * GiB) == 80 * GiB
    led = MemoryLedger(0.9, device="cuda:0", device_total=100 * GiB, device_free=95 * GiB)
    assert led.budget == 90 * GiB


@pytest.mark.parametrize("budget, total, free, match", [
    (0.5, None, None, "needs the device's total"),
    (1.5, 80 * GiB, None, r"in \(0, 1\]"),
    (0.0, 80 * GiB, None, r"in \(0, 1\]"),
    (0, None, None, "> 0 bytes"),
    (-5, None, None, "> 0 bytes"),
    (81 * GiB, 80 * GiB, None, "exceeds the device"),
    (0.9, 80 * GiB, 60 * GiB, "free on the device"),
    ("8GiB", None, None, "bytes or a fraction"),
    (True, None, None, "bytes or a fraction"),
])
def test_bad_budgets_are_refused(budget, total, free, match):
    with pytest.raises(LedgerError, match=match):
        resolve_budget(budget, device_total=total, device_free=free)


def test_cpu_ledger_needs_bytes():
    with pytest.raises(LedgerError, match="on CPU give the budget in bytes"):
        MemoryLedger(0.9, device="cpu")
    assert MemoryLedger(4 * GiB).budget == 4 * GiB


def test_fit_without_eviction_plans_the_pool():
    led = MemoryLedger(40 * GiB)
    plan = led.check_load("a", 16 * GiB, 2 * GiB, 1 * GiB)
    assert plan.evict == () and plan.evict_frees == 0
    assert plan.needed == 19 * GiB and plan.free == 40 * GiB
    assert plan.kv_pool_bytes_after == 22 * GiB  # everything beside weights and workspace
    assert "a" not in led  # checking books nothing


def load(led: MemoryLedger, name: str, weights: int, workspace: int, kv_min: int,
         evictable=(), step: int = 0) -> None:
    """The load sequence of docs/multi-model.md, minus the GPU."""
    plan = led.check_load(name, weights, workspace, kv_min, evictable, step_bytes=step)
    for victim in plan.evict:
        led.release(victim)
    kv_min_total = sum(led.snapshot().kv_min.values())
    led.set_kv_pool(max(kv_min_total, min(led.snapshot().kv_pool_bytes, plan.kv_pool_bytes_after)))
    led.reserve_weights(name, weights, workspace_estimate=workspace, min_kv_bytes=kv_min, step_bytes=step)
    led.set_kv_pool(plan.kv_pool_bytes_after)
    assert led.snapshot().free == 0  # the pool takes all the rest


def test_book_measure_release_returns_to_start():
    led = MemoryLedger(40 * GiB)
    start = led.snapshot()
    load(led, "a", 10 * GiB, 1 * GiB, 1 * GiB)
    load(led, "b", 12 * GiB, 1 * GiB, 2 * GiB)
    snap = led.snapshot()
    assert snap.weights == {"a": 10 * GiB, "b": 12 * GiB}
    assert snap.kv_pool_bytes == 40 * GiB - 24 * GiB
    assert snap.used == 40 * GiB and snap.free == 0
    assert led.record_workspace("a", 1 * GiB + 300 * MiB) == 300 * MiB  # estimate was low
    assert led.record_workspace("b", 512 * MiB) == -512 * MiB
    assert led.model_bytes("a") == 11 * GiB + 300 * MiB
    assert led.snapshot().used == 40 * GiB - 212 * MiB
    assert led.release("a") == 10 * GiB + 1 * GiB + 300 * MiB + 1 * GiB
    assert led.release("b") == 12 * GiB + 512 * MiB + 2 * GiB
    led.set_kv_pool(0)
    assert led.snapshot() == start


def test_eviction_takes_the_shortest_lru_prefix():
    led = MemoryLedger(40 * GiB)
    load(led, "old", 8 * GiB, 1 * GiB, 1 * GiB)  # 10 GiB committed each
    load(led, "mid", 8 * GiB, 1 * GiB, 1 * GiB)
    load(led, "new", 8 * GiB, 1 * GiB, 1 * GiB)
    # 10 GiB free + elastic KV; a 18 GiB load needs one eviction, the least recently used.
    plan = led.check_load("big", 16 * GiB, 1 * GiB, 1 * GiB, evictable=["old", "mid", "new"])
    assert plan.free == 10 * GiB and plan.needed == 18 * GiB
    assert plan.evict == ("old",) and plan.evict_frees == 10 * GiB
    assert plan.kv_pool_bytes_after == 40 * GiB - 18 * GiB - 17 * GiB
    load(led, "big", 16 * GiB, 1 * GiB, 1 * GiB, evictable=["old", "mid", "new"])
    assert set(led.snapshot().weights) == {"mid", "new", "big"}
    assert led.snapshot().used <= led.budget
    plan = led.check_load("x", 15 * GiB, 0, 1 * GiB, evictable=["new", "mid", "new"])
    assert plan.evict == ("new", "mid")  # duplicates ignored, order kept


def test_refusal_carries_the_numbers():
    led = MemoryLedger(40 * GiB)
    load(led, "a", 10 * GiB, 1 * GiB, 1 * GiB)
    load(led, "pinned", 12 * GiB, 1 * GiB, 1 * GiB)
    with pytest.raises(LoadRefused) as info:
        led.check_load("huge", 30 * GiB, 2 * GiB, 1 * GiB, evictable=["a"])
    e = info.value
    assert isinstance(e, EngineError)
    assert (e.needed, e.free, e.evictable, e.budget) == (33 * GiB, 14 * GiB, 12 * GiB, 40 * GiB)
    assert e.short == 7 * GiB and e.evictable_models == ("a",) and e.model == "huge"
    msg = str(e)
    for part in ("'huge'", format_bytes(33 * GiB), "weights " + format_bytes(30 * GiB),
                 "workspace " + format_bytes(2 * GiB), "min KV " + format_bytes(1 * GiB),
                 format_bytes(14 * GiB) + " free", format_bytes(40 * GiB) + " budget",
                 "evicting idle a would free " + format_bytes(12 * GiB),
                 "short by " + format_bytes(7 * GiB), "35433480192 B"):
        assert part in msg, (part, msg)
    with pytest.raises(LoadRefused, match="no idle model may be evicted") as info:
        led.check_load("huge", 30 * GiB, 2 * GiB, 1 * GiB)
    assert info.value.evictable == 0 and info.value.short == 19 * GiB
    assert set(led.snapshot().weights) == {"a", "pinned"}  # a refusal changes nothing


def test_reserve_refuses_when_the_pool_was_not_shrunk_first():
    led = MemoryLedger(10 * GiB)
    load(led, "a", 4 * GiB, 0, 1 * GiB)  # pool takes the other 6 GiB
    plan = led.check_load("b", 3 * GiB, 0, 1 * GiB)  # fits: 5 GiB of the pool is elastic
    assert plan.kv_pool_bytes_after == 3 * GiB
    before = led.snapshot()
    with pytest.raises(LedgerError, match=r"shrink the KV pool to 3.00 GiB .* before booking 'b'"):
        led.reserve_weights("b", 3 * GiB, min_kv_bytes=1 * GiB)
    assert led.snapshot() == before
    led.set_kv_pool(plan.kv_pool_bytes_after)
    led.reserve_weights("b", 3 * GiB, min_kv_bytes=1 * GiB)
    assert led.snapshot().free == 0
    with pytest.raises(LoadRefused) as info:  # a booking past the budget names its numbers
        led.reserve_weights("c", 1 * GiB + 1)
    assert (info.value.needed, info.value.free) == (1 * GiB + 1, 10 * GiB - 7 * GiB - 2 * GiB)


def test_pool_and_minimum_rules():
    led = MemoryLedger(10 * GiB)
    led.reserve_weights("a", 4 * GiB, workspace_estimate=1 * GiB, min_kv_bytes=2 * GiB)
    with pytest.raises(LedgerError, match="does not fit"):
        led.set_kv_pool(5 * GiB + 1)
    with pytest.raises(LedgerError, match="guaranteed minimums"):
        led.set_kv_pool(1 * GiB)
    led.set_kv_pool(5 * GiB)
    with pytest.raises(LedgerError, match="exceeds the budget"):
        led.set_kv_minimum("a", 5 * GiB + 1)
    led.set_kv_minimum("a", 3 * GiB)
    assert led.snapshot().kv_min == {"a": 3 * GiB}


def test_bad_bookings_are_typed_errors():
    led = MemoryLedger(10 * GiB)
    led.reserve_weights("a", 1 * GiB)
    with pytest.raises(LedgerError, match="already booked"):
        led.reserve_weights("a", 1)
    with pytest.raises(LedgerError, match="already booked"):
        led.check_load("a", 1, 0, 0)
    with pytest.raises(LedgerError, match="not booked"):
        led.check_load("b", 1, 0, 0, evictable=["ghost"])
    for call in (lambda: led.release("ghost"), lambda: led.record_workspace("ghost", 1),
                 lambda: led.model_bytes("ghost"), lambda: led.set_kv_minimum("ghost", 0)):
        with pytest.raises(LedgerError, match="not booked"):
            call()
    for bad in (-1, 1.5, None, True):
        with pytest.raises(LedgerError, match="non-negative int"):
            led.check_load("b", bad, 0, 0)
        with pytest.raises(LedgerError, match="non-negative int"):
            led.record_workspace("a", bad)


def test_verify_against_allocator():
    led = MemoryLedger(10 * GiB)
    led.reserve_weights("a", 4 * GiB, workspace_estimate=512 * MiB)
    led.set_kv_pool(2 * GiB)
    booked = 4 * GiB + 512 * MiB + 2 * GiB
    check = led.verify_against_allocator(reserved_bytes=booked + 100 * MiB)
    assert check.ok and check.drift == 100 * MiB and check.ledger_bytes == booked
    check = led.verify_against_allocator(reserved_bytes=booked + 300 * MiB)
    assert not check.ok and check.drift == 300 * MiB
    assert led.verify_against_allocator(reserved_bytes=booked - GiB).ok  # over-booked is safe
    none = led.verify_against_allocator()  # CPU: nothing to compare with
    assert none.ok and none.allocator_reserved is None


def test_concurrent_bookings_never_exceed_the_budget():
    led = MemoryLedger(100 * MiB)
    refused: list[str] = []

    def worker(i: int) -> None:
        for j in range(50):
            try:
                led.reserve_weights(f"m{i}-{j}", 3 * MiB)
            except LoadRefused:
                refused.append(f"m{i}-{j}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = led.snapshot()
    assert len(snap.weights) == 33 and snap.used == 99 * MiB
    assert len(refused) == 200 - 33


def test_what_the_device_holds_beyond_the_books_is_charged_until_the_next_reconcile():
    led = MemoryLedger(100 * GiB)
    led.reserve_weights("a", 10 * GiB, workspace_estimate=2 * GiB, min_kv_bytes=1 * GiB)
    led.set_kv_pool(20 * GiB)
    assert led.reconcile(30 * GiB) == 0  # the device holds less than booked: nothing changes
    assert led.reconcile(40 * GiB) == 8 * GiB  # 8 GiB no booking explains (library scratch, pools)
    snap = led.snapshot()
    assert snap.untracked == 8 * GiB and snap.used == 40 * GiB and snap.free == 60 * GiB
    # a load is decided against the device's figure: 80 GiB fit the books (87 free) but not the device
    with pytest.raises(LoadRefused) as ex:
        led.check_load("b", 70 * GiB, 8 * GiB, 2 * GiB)
    assert ex.value.free == 100 * GiB - 13 * GiB - 8 * GiB
    plan = led.check_load("b", 60 * GiB, 5 * GiB, 2 * GiB)
    assert plan.kv_pool_bytes_after == 100 * GiB - 12 * GiB - 8 * GiB - 65 * GiB
    with pytest.raises(EngineError):  # the pool cannot grow into what the device holds
        led.set_kv_pool(81 * GiB)
    led.reconcile(32 * GiB)
    assert led.snapshot().untracked == 0 and led.snapshot().free == 100 * GiB - 32 * GiB
    with pytest.raises(EngineError):
        led.reconcile(-1)


def test_cached_free_segments_of_the_default_pool_are_not_the_engines():
    from engine.core.pool_keeper import free_default_segments

    segs = [{"device": 0, "total_size": 100, "allocated_size": 0, "segment_pool_id": (0, 0)},  # reclaimable
            {"device": 0, "total_size": 50, "allocated_size": 10, "segment_pool_id": (0, 0)},  # partly live
            {"device": 0, "total_size": 70, "allocated_size": 0, "segment_pool_id": (1, 3)},  # a graph's pool
            {"device": 1, "total_size": 30, "allocated_size": 0, "segment_pool_id": (0, 0)}]  # another device
    assert free_default_segments(segs, 0) == 100 and free_default_segments(segs, 1) == 30


def test_a_vacancy_is_on_the_device_but_a_loads_to_take():
    """An unloaded model's memory kept for the next load (engine/core/vacancy.py): in ``used``
    (the device holds it; the pool cannot grow into it; the device's figure is explained by it),
    room to a load (which drops it first when it needs it), never offered as a model to evict,
    its KV minimum gone."""
    led = MemoryLedger(100 * GiB, device="cpu")
    led.set_kv_pool(20 * GiB)
    led.reserve_weights("a", 30 * GiB, workspace_estimate=2 * GiB, min_kv_bytes=4 * GiB)
    led.reserve_weights("b", 30 * GiB, workspace_estimate=2 * GiB, min_kv_bytes=4 * GiB)
    before = led.snapshot()
    led.vacate("a", "\0vacant:a")
    snap = led.snapshot()
    assert snap.used == before.used and snap.kv_min == {"\0vacant:a": 0, "b": 4 * GiB}
    assert led.room() == 100 * GiB - 36 * GiB  # b alone is committed
    plan = led.check_load("c", 30 * GiB, 2 * GiB, 4 * GiB)  # fits with a's room: its keeper drops a first
    assert plan.evict == () and plan.free == 100 * GiB - 36 * GiB
    with pytest.raises(LedgerError, match="not booked"):
        led.check_load("c", 30 * GiB, 2 * GiB, 4 * GiB, evictable=["\0vacant:a"])
    with pytest.raises(LedgerError, match="does not fit"):
        led.set_kv_pool(100 * GiB - 64 * GiB + 1)  # not into the vacancy
    assert led.reconcile(snap.used) == 0  # the device's figure, explained by the books
    with pytest.raises(LedgerError, match="already booked"):
        led.vacate("b", "\0vacant:a")
    assert led.release("\0vacant:a") == 32 * GiB  # dropped (PoolKeeper._book): the pool may have its room
    assert led.check_load("c", 30 * GiB, 2 * GiB, 4 * GiB).kv_pool_bytes_after == 100 * GiB - 2 * 32 * GiB
    led.release("b")
    assert led.snapshot().used == 20 * GiB


def test_the_largest_step_is_booked_once_for_all_models():
    """At most two steps are on the device at once: the booking is room for two of the largest
    model's step, whatever the number of models (not a sum over them)."""
    led = MemoryLedger(40 * GiB)
    load(led, "a", 10 * GiB, 1 * GiB, 1 * GiB, step=2 * GiB)
    load(led, "b", 10 * GiB, 1 * GiB, 1 * GiB, step=3 * GiB)
    snap = led.snapshot()
    assert snap.step == STEPS_IN_FLIGHT * 3 * GiB == 6 * GiB and snap.workspace == {"a": 1 * GiB, "b": 1 * GiB}
    assert snap.used == 20 * GiB + 2 * GiB + 6 * GiB + snap.kv_pool_bytes == 40 * GiB
    # a load whose step is within the booking needs no room for it; a larger one, twice the difference
    assert led.check_load("c", 1 * GiB, 0, 0, step_bytes=3 * GiB).needed == 1 * GiB
    assert led.step_more(3 * GiB) == 0 and led.step_more(5 * GiB) == 4 * GiB
    plan = led.check_load("c", 1 * GiB, 0, 0, step_bytes=5 * GiB)
    assert plan.needed == 5 * GiB
    assert plan.kv_pool_bytes_after == 40 * GiB - 22 * GiB - 1 * GiB - 10 * GiB
    led.release("b")  # the largest step goes with its model
    assert led.snapshot().step == 4 * GiB
    assert led.record_workspace("a", 1 * GiB, 4 * GiB) == 4 * GiB  # measured: the booking's change
    assert led.snapshot().step == 8 * GiB


def test_evicting_the_model_with_the_largest_step_counts_what_the_booking_drops():
    led = MemoryLedger(40 * GiB)
    load(led, "big", 10 * GiB, 1 * GiB, 1 * GiB, step=6 * GiB)
    load(led, "small", 10 * GiB, 1 * GiB, 1 * GiB, step=1 * GiB)
    # 4 GiB free beside the minimums; evicting "big" frees its 12 GiB and 10 of the step booking
    plan = led.check_load("c", 4 * GiB, 1 * GiB, 1 * GiB, ["big", "small"], step_bytes=2 * GiB)
    assert plan.evict == ("big",) and plan.needed == 6 * GiB
    assert plan.kv_pool_bytes_after == 40 * GiB - 11 * GiB - 2 * GiB - 5 * GiB - 2 * GiB
    with pytest.raises(LoadRefused) as e:
        led.check_load("d", 25 * GiB, 1 * GiB, 1 * GiB, ["big"], step_bytes=8 * GiB)
    r = e.value
    assert r.parts["step"] == 4 * GiB  # twice what it adds to the largest, 6 GiB
    assert "step " + format_bytes(4 * GiB) in str(r)
    # evicting "big" frees 22 GiB, but d's step then adds twice 7 GiB, not twice 2: 12 net
    assert (r.needed, r.free, r.evictable) == (31 * GiB, 4 * GiB, 12 * GiB)
    assert r.short == 15 * GiB
    assert led.net_frees(["big"], 8 * GiB) == 12 * GiB and led.net_frees(["big"]) == 22 * GiB
    assert led.net_frees(["small"]) == 12 * GiB  # its step is not the largest: the booking stays


def test_a_vacancy_takes_no_steps_and_the_device_figure_leaves_the_step_out():
    led = MemoryLedger(40 * GiB)
    load(led, "a", 10 * GiB, 1 * GiB, 1 * GiB, step=3 * GiB)
    led.vacate("a", "\0a")
    assert led.snapshot().step == 0
    load(led, "b", 10 * GiB, 1 * GiB, 1 * GiB, step=2 * GiB)
    pool = led.snapshot().kv_pool_bytes
    # the device holds weights, workspaces and the pool; a finished step's blocks are cached free
    # (left out of the figure): nothing untracked although 2 GiB of step are booked
    assert led.reconcile(20 * GiB + 2 * GiB + pool) == 0
    assert led.reconcile(20 * GiB + 2 * GiB + pool + 1 * GiB) == 1 * GiB

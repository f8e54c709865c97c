"""Cascade plans (engine/runner/cascade.py): which one-token rows read a shared prefix together.

A plan is only ever an optimisation, so what must hold is that it is *safe* — every planned row
really begins with the shared pages it is told to skip, never the page its token is written
to, and appears once — and that it finds the sharing a prefix cache produces."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from engine.runner.cascade import LONG_ROW_TOKENS, MIN_PAGES, max_tiles, plan_cascade, rows_per_tile

BS = 16


def _batch(rows: list[list[int]], seq_lens: list[int], width: int = 40):
    tables = np.zeros((len(rows), width), dtype=np.int32)
    for i, pages in enumerate(rows):
        tables[i, :len(pages)] = pages
    return tables, np.asarray(seq_lens, dtype=np.int64)


def _plan(*args, **kw):
    """(tiles, kv_lo, rows sharing a prefix) of a plan that split no long row."""
    plan = plan_cascade(*args, **kw)
    assert plan.long == 0
    return plan.tiles, plan.kv_lo, plan.shared


def _check(tables, seq_lens, q_lens, tiles, kv_lo, per_tile):
    """The plan's safety invariants."""
    seen = set()
    for t in tiles:
        plen = int(t[1])
        members = [int(r) for r in t[2:] if r >= 0]
        if plen == 0:
            assert not members
            continue
        assert plen % BS == 0 and members and len(members) <= per_tile
        pages = plen // BS
        for r in members:
            assert r not in seen
            seen.add(r)
            assert q_lens[r] == 1
            assert kv_lo[r] == plen
            assert pages <= (seq_lens[r] - 1) // BS  # never the page the row's token is in
            assert (tables[r, :pages] == tables[int(t[0]), :pages]).all()
    assert {int(r) for r in np.flatnonzero(kv_lo)} == seen


def test_rows_that_share_a_system_prompt_form_one_group():
    shared = list(range(100, 164))  # 64 pages = 1,024 tokens
    rows = [shared + [200 + 3 * i, 201 + 3 * i] for i in range(20)] + [[900, 901, 902, 903, 904, 905]]
    tables, lens = _batch(rows, [64 * BS + 20] * 20 + [90], width=70)
    q = np.ones(21, dtype=np.int64)
    tiles, kv_lo, planned = _plan(tables, lens, q, BS, 16, max_tiles(21, 16))
    assert planned == 20
    assert (kv_lo[:20] == 64 * BS).all() and kv_lo[20] == 0
    active = tiles[tiles[:, 1] > 0]
    assert len(active) == 2  # 20 rows, 16 a tile
    _check(tables, lens, q, tiles, kv_lo, 16)


def test_two_prompts_under_a_common_header_are_two_groups_not_one():
    """Rows agreeing on one page (a template header) and then on two different system prompts:
    the deeper groups save more reads than one group at depth 1."""
    head = [7]
    a = head + list(range(10, 30))
    b = head + list(range(40, 60))
    rows = [a + [100 + i] for i in range(8)] + [b + [200 + i] for i in range(8)]
    tables, lens = _batch(rows, [22 * BS - 3] * 16)
    q = np.ones(16, dtype=np.int64)
    tiles, kv_lo, planned = _plan(tables, lens, q, BS, 16, max_tiles(16, 16))
    assert planned == 16 and (kv_lo == 21 * BS).all()
    assert sorted(int(t[0]) < 8 for t in tiles if t[1]) == [False, True]
    _check(tables, lens, q, tiles, kv_lo, 16)


def test_the_page_being_written_and_short_prefixes_are_never_shared():
    # two rows whose tables agree on every page they have (a fork that has not diverged yet):
    # the last page holds their tokens, so only the full pages before it are planned
    pages = list(range(30, 36))
    tables, lens = _batch([pages, pages], [6 * BS, 5 * BS + 1])
    q = np.ones(2, dtype=np.int64)
    tiles, kv_lo, planned = _plan(tables, lens, q, BS, 16, max_tiles(2, 16))
    assert planned == 2 and (kv_lo == 5 * BS).all()
    _check(tables, lens, q, tiles, kv_lo, 16)
    # fewer than MIN_PAGES shared pages: no plan
    short = list(range(MIN_PAGES - 1))
    tables, lens = _batch([short + [50], short + [60]], [MIN_PAGES * BS + 3] * 2)
    assert _plan(tables, lens, q, BS, 16, 9)[2] == 0


def test_prefill_rows_are_not_planned_and_the_tile_budget_holds():
    shared = list(range(100, 110))
    rows = [shared + [200 + i] for i in range(6)]
    tables, lens = _batch(rows, [11 * BS - 1] * 6)
    q = np.array([1, 1, 5, 1, 1, 1])  # row 2 is a prefill chunk: the prefill kernel's
    tiles, kv_lo, planned = _plan(tables, lens, q, BS, 2, 3)  # 5 rows need 3 tiles of 2
    assert planned == 5 and kv_lo[2] == 0
    _check(tables, lens, q, tiles, kv_lo, 2)
    tiles, kv_lo, planned = _plan(tables, lens, q, BS, 2, 2)  # no room: nothing planned
    assert planned == 0 and not kv_lo.any() and not tiles[:, 1].any()


def test_rows_per_tile_fills_64_query_rows():
    assert rows_per_tile(32, 8) == 16
    assert rows_per_tile(32, 32) == 64
    assert rows_per_tile(64, 8) == 8


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.data())
def test_random_batches_give_safe_plans(data):
    """Tables drawn as forks of a few prompts (as the prefix cache shares pages): every plan
    keeps the invariants, and where two rows share MIN_PAGES full pages a group is found."""
    n = data.draw(st.integers(2, 40))
    per_tile = data.draw(st.sampled_from([1, 2, 4, 16]))
    trunks = [list(range(1000 * k, 1000 * k + 30)) for k in range(3)]
    rows, lens, q = [], [], []
    fresh = iter(range(50_000, 60_000))
    for _ in range(n):
        trunk = trunks[data.draw(st.integers(0, 2))]
        keep = data.draw(st.integers(0, 30))
        extra = data.draw(st.integers(1, 6))
        pages = trunk[:keep] + [next(fresh) for _ in range(extra)]
        rows.append(pages)
        lens.append((len(pages) - 1) * BS + data.draw(st.integers(1, BS)))
        q.append(data.draw(st.sampled_from([1, 1, 1, 3])))
    tables, seq_lens = _batch(rows, lens, width=40)
    q_lens = np.asarray(q)
    num_tiles = data.draw(st.sampled_from([1, 2, max_tiles(n, per_tile)]))
    # long rows: none (the default bound), or rows of 4+ pages of their own split by spare tiles
    long_tokens = data.draw(st.sampled_from([LONG_ROW_TOKENS, 4 * BS]))
    plan = plan_cascade(tables, seq_lens, q_lens, BS, per_tile, num_tiles, long_row_tokens=long_tokens)
    tiles, kv_lo, planned = plan.tiles, plan.kv_lo, plan.shared
    assert tiles.shape == (num_tiles, 2 + per_tile)
    _check(tables, seq_lens, q_lens, tiles, kv_lo, per_tile)
    assert plan.rows == int((kv_lo > 0).sum()) and int((tiles[:, 1] > 0).sum()) <= num_tiles
    solo = [t for t in tiles if t[1] > 0 and t[2] >= 0 and (t[3:] < 0).all() and t[0] == t[2]
            and t[1] == (seq_lens[t[0]] - 1) // BS * BS]
    assert plan.long <= len(solo)
    if long_tokens == LONG_ROW_TOKENS:
        assert plan.long == 0
    full = (seq_lens - 1) // BS
    one = [i for i in range(n) if q_lens[i] == 1]
    shares = any(min(full[i], full[j]) >= MIN_PAGES
                 and (tables[i, :MIN_PAGES] == tables[j, :MIN_PAGES]).all()
                 for i in one for j in one if i < j)
    if per_tile >= 2 and shares and num_tiles == max_tiles(n, per_tile) and plan.long == 0:
        assert planned >= 2  # a tile of one row saves nothing, so no group of one is planned


def test_a_chain_of_nested_prefixes_does_not_recurse_row_by_row():
    """One conversation's turns running at once: row i's table is row i-1's plus one page. The
    trie would split once per row (1,100 deep: past Python's recursion limit); the split depth is
    bounded and the plan stays safe."""
    n = 1100
    base = list(range(1, 8))
    tables = np.zeros((n, len(base) + n + 1), dtype=np.int32)
    lens = np.zeros(n, dtype=np.int64)
    for i in range(n):
        pages = base + list(range(100, 100 + i)) + [5000 + i]
        tables[i, :len(pages)] = pages
        lens[i] = (len(pages) - 1) * BS + 3
    q = np.ones(n, dtype=np.int64)
    tiles, kv_lo, planned = _plan(tables, lens, q, BS, 16, max_tiles(n, 16), long_row_tokens=1 << 30)  # sharing only
    assert planned > 0
    _check(tables, lens, q, tiles, kv_lo, 16)


def test_a_long_row_beside_short_ones_gets_a_tile_of_its_own():
    """Rows that share nothing: those with a context of LONG_ROW_TOKENS of their own take the
    spare tiles, longest first, their full pages as the tile's length (the page being written
    stays the decode kernel's); short rows and prefill chunks are left alone."""
    long_pages = LONG_ROW_TOKENS // BS
    fresh = iter(range(1, 100_000))
    rows = [[next(fresh) for _ in range(n)] for n in (3, long_pages + 1, 2, 2 * long_pages + 1, long_pages, 5)]
    lens = [(len(p) - 1) * BS + 7 for p in rows]
    tables, seq_lens = _batch(rows, lens, width=2 * long_pages + 2)
    q = np.array([1, 1, 1, 1, 1, 3])
    plan = plan_cascade(tables, seq_lens, q, BS, 16, max_tiles(6, 16))
    assert plan.shared == 0 and plan.long == 2
    assert plan.kv_lo[1] == long_pages * BS and plan.kv_lo[3] == 2 * long_pages * BS
    assert plan.kv_lo[[0, 2, 5]].tolist() == [0, 0, 0]
    # row 4 holds LONG_ROW_TOKENS positions, one page of them being written: not long enough
    assert plan.kv_lo[4] == 0
    active = plan.tiles[plan.tiles[:, 1] > 0]
    assert [int(t[0]) for t in active] == [3, 1]  # longest first
    assert all(int(t[2]) == int(t[0]) and (t[3:] == -1).all() for t in active)
    _check(tables, seq_lens, q, plan.tiles, plan.kv_lo, 16)
    # one spare tile: the longest row takes it
    plan = plan_cascade(tables, seq_lens, q, BS, 16, 1)
    assert plan.long == 1 and plan.kv_lo[3] > 0 and plan.kv_lo[1] == 0


def test_shared_prefixes_come_before_long_rows():
    """A group saves reads; a long row's tile only splits it. With one tile the group takes it
    and the long rows run unplanned. Spare tiles go to the longest own contexts: an unshared
    row first, then a row of the group whose context past the shared prompt is long (a 4k
    conversation under a system prompt): it leaves its group for a tile of its own."""
    long_pages = LONG_ROW_TOKENS // BS
    shared = list(range(1, 9))
    rows = [shared + [100], shared + [101], list(range(200, 200 + 2 * long_pages + 1)),
            shared + list(range(5000, 5000 + long_pages + 1))]
    lens = [(len(p) - 1) * BS + 3 for p in rows]
    tables, seq_lens = _batch(rows, lens, width=2 * long_pages + 10)
    q = np.ones(4, dtype=np.int64)
    plan = plan_cascade(tables, seq_lens, q, BS, 16, 1)
    assert plan.shared == 3 and plan.long == 0 and plan.kv_lo[2] == 0 and plan.kv_lo[3] == len(shared) * BS
    plan = plan_cascade(tables, seq_lens, q, BS, 16, 2)
    assert plan.shared == 3 and plan.long == 1 and plan.kv_lo[2] == 2 * long_pages * BS
    assert plan.kv_lo[3] == len(shared) * BS  # still the group's: no tile left for it
    _check(tables, seq_lens, q, plan.tiles, plan.kv_lo, 16)
    plan = plan_cascade(tables, seq_lens, q, BS, 16, 3)
    assert plan.shared == 2 and plan.long == 2
    assert plan.kv_lo[3] == (len(shared) + long_pages) * BS  # its whole context, in a tile of its own
    group = plan.tiles[0]
    assert sorted(int(r) for r in group[2:] if r >= 0) == [0, 1]
    _check(tables, seq_lens, q, plan.tiles, plan.kv_lo, 16)


def test_a_group_whose_every_row_is_long_leaves_no_tile_behind():
    long_pages = LONG_ROW_TOKENS // BS
    shared = list(range(1, 9))
    rows = [shared + list(range(1000 * k, 1000 * k + long_pages + 1)) for k in (1, 2)]
    tables, seq_lens = _batch(rows, [(len(p) - 1) * BS + 3 for p in rows], width=long_pages + 10)
    q = np.ones(2, dtype=np.int64)
    plan = plan_cascade(tables, seq_lens, q, BS, 16, 3)
    assert plan.shared == 0 and plan.long == 2
    assert int((plan.tiles[:, 1] > 0).sum()) == 2
    _check(tables, seq_lens, q, plan.tiles, plan.kv_lo, 16)

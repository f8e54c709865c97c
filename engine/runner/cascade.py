"""Cascade attention plans: which one-token rows of a step read a shared prefix together.

With the prefix cache on, the rows of a decode step often begin with the same physical pages (a
system prompt every request of an app carries; a fan-out of one prompt). Each row's decode
attention reads its whole context, so a 1,024-token prefix shared by 50 running sequences is
read 50 times a step. A plan groups such rows: the cascade kernel
(engine/kernels/attention_triton.py) reads the group's shared pages once per *tile* of up to
``rows_per_tile`` rows, for all of them at once, and each row's decode reads only what follows.
On the H200 with the 8B (shared 1,024-token prompt, c200) decode attention was most of a
decode-only step (docs/perf.md, issue 20): reads of the shared prefix are what this removes.

Planning is host work in every step of a large enough batch, so it is numpy over the step's
block-table array and touches only the rows that can share: one-token rows with at least
``min_pages`` full pages before the page their token is in (that page is being written, so it
is never shared). Rows are split by their page at each depth, like a trie walked only where
rows still agree, and at every node the plan takes whichever is larger: the node as one group
(its rows share ``lcp`` pages) or the best of its children (fewer rows, longer prefixes). The
gain of a group counts page reads saved: ``(rows - tiles) * pages``. A static grid bounds the
tiles (``max_tiles``); groups that do not fit are dropped, least gain first.

**Long rows.** The tiles a plan leaves go to rows with a long context of their own (past any
prefix they share), longest first: a tile of one row, its full pages as the "prefix" (a row of
a group leaves it). That saves no reads; it splits the row. A batch of 33 rows and more runs
the decode kernel unsplit (one program per row and KV head), so one 32k-token row beside short
ones was walked by one program a layer, 16 MB of K/V at one SM's pace, and every row of the
step waited for it. As a tile the row's context is read by ``CASCADE_SPLITS`` programs at once
(H100: a 32k row beside 64 short ones, one layer 1.01 → 0.22 ms; docs/perf.md, 2026-12-06).

Torch-free: the runner stages the arrays (``tiles``, ``kv_lo``) into its step buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Batches below this many rows get no plan (and no cascade kernel): the latency buckets, where
# an extra launch per layer would cost more than any sharing saves.
MIN_ROWS = 16
# The least shared length worth a group: below it the prefix is a chat template's header.
MIN_PAGES = 4
# Tiles beyond cdiv(rows, rows_per_tile): each group may end in a partial tile.
EXTRA_TILES = 8
# How deep the split into ever longer shared prefixes goes.
MAX_LEVELS = 16
# A row whose own context (past any shared prefix) is at least this long takes a spare tile: one
# program walking 4,096 positions reads 2 MB of K/V per KV head and layer (8B, bf16), several
# times a short row's whole decode.
LONG_ROW_TOKENS = 4096


@dataclass(frozen=True)
class CascadePlan:
    """One step's plan: ``tiles [num_tiles, 2 + per_tile] int32`` (a row of the group, the shared
    length in tokens, up to ``per_tile`` rows, -1 padded; unused tiles have length 0), ``kv_lo
    [B] int32`` (each row's planned length, 0 outside the plan), and how many rows read a prefix
    shared with others (``shared``) or had their own long context split (``long``)."""

    tiles: np.ndarray
    kv_lo: np.ndarray
    shared: int
    long: int

    @property
    def rows(self) -> int:
        return self.shared + self.long


def rows_per_tile(num_heads: int, num_kv_heads: int) -> int:
    """Rows a cascade tile holds: 64 query rows of (row, head-of-the-GQA-group) pairs."""
    return max(1, 64 // (num_heads // num_kv_heads))


def max_tiles(rows: int, per_tile: int) -> int:
    """The tile count of a batch of ``rows`` rows: the cascade kernel's grid, fixed per shape."""
    return -(-rows // per_tile) + EXTRA_TILES


def _lcp(sub: np.ndarray) -> int:
    """How many leading columns of ``sub`` are equal in every row."""
    if sub.shape[1] == 0 or not (sub[:, 0] == sub[0, 0]).all():
        return 0
    eq = (sub == sub[:1]).all(axis=0)
    return sub.shape[1] if eq.all() else int(eq.argmin())


def _best(tables: np.ndarray, full: np.ndarray, rows: np.ndarray, depth: int, per_tile: int,
          min_pages: int, level: int = 0) -> tuple[int, list[tuple[np.ndarray, int]]]:
    """(page reads saved, groups) for ``rows``, which agree on their first ``depth`` pages; below
    MAX_LEVELS splits a node is taken whole (a chain of nested prefixes, one conversation's
    turns, would otherwise recurse once per row)."""
    fr = full[rows]
    lcp = depth + _lcp(tables[rows, depth:int(fr.min())])
    n = len(rows)
    here = (n - -(-n // per_tile)) * lcp if lcp >= min_pages else 0
    deeper = rows[fr > lcp]
    if len(deeper) >= 2 and level < MAX_LEVELS:
        col = tables[deeper, lcp]
        order = np.argsort(col, kind="stable")
        col = col[order]
        cut = col[1:] != col[:-1]
        if not cut.all():  # some rows share their next page too (most nodes: none do)
            deeper = deeper[order]
            bounds = np.concatenate(([0], np.flatnonzero(cut) + 1, [len(col)]))
            total, groups = 0, []
            for k in np.flatnonzero(np.diff(bounds) >= 2):  # only runs of rows that share the page
                gain, sub = _best(tables, full, deeper[bounds[k]:bounds[k + 1]], lcp + 1, per_tile, min_pages,
                                  level + 1)
                total += gain
                groups += sub
            if total > here:
                return total, groups
    return here, ([(rows, lcp)] if here else [])


def plan_cascade(tables: np.ndarray, seq_lens: np.ndarray, q_lens: np.ndarray, block_size: int,
                 per_tile: int, num_tiles: int, min_pages: int = MIN_PAGES,
                 long_row_tokens: int = LONG_ROW_TOKENS) -> CascadePlan:
    """The plan of one step. ``tables[B, W]`` are the step's block tables, ``seq_lens`` /
    ``q_lens`` each row's context length after the step and its query length. Shared prefixes
    first; the tiles left go to rows of at least ``long_row_tokens`` of their own."""
    b = len(seq_lens)
    tiles = np.full((num_tiles, 2 + per_tile), -1, dtype=np.int32)
    tiles[:, 1] = 0
    kv_lo = np.zeros(b, dtype=np.int32)
    full = (np.asarray(seq_lens, dtype=np.int64) - 1) // block_size
    cand = np.flatnonzero((np.asarray(q_lens) == 1) & (full >= min_pages))
    t = shared = 0
    first = np.sort(tables[cand, 0])
    if len(cand) >= 2 and (first[1:] == first[:-1]).any():  # two rows share a first page
        # the root: rows agree on no page yet; its children are split by their first page
        _, groups = _best(tables, full, cand, 0, per_tile, min_pages)
        groups.sort(key=lambda g: (len(g[0]) - -(-len(g[0]) // per_tile)) * g[1], reverse=True)
        for rows, pages in groups:
            need = -(-len(rows) // per_tile)
            if t + need > num_tiles:
                continue
            members = np.full(need * per_tile, -1, dtype=np.int32)  # the group's rows in order, -1 after
            members[:len(rows)] = rows
            tiles[t:t + need, 2:] = members.reshape(need, per_tile)
            tiles[t:t + need, 0] = rows[0]
            tiles[t:t + need, 1] = pages * block_size
            t += need
            kv_lo[rows] = pages * block_size
            shared += len(rows)
    # a row's own context: past its group's prefix (a 32k conversation under a shared system
    # prompt is as long a walk as one without); a grouped row taking a tile of its own leaves a
    # hole (-1) in its group's tile, and its tile reads the shared pages again (the prefix is
    # short beside what it splits)
    own = full[cand] * block_size - kv_lo[cand]
    keep = own >= long_row_tokens
    if t == num_tiles or not keep.any():  # (most steps: nothing more to plan)
        return CascadePlan(tiles, kv_lo, shared, 0)
    long = cand[keep][np.argsort(-own[keep], kind="stable")][:num_tiles - t]
    grouped = t
    for r in long:
        if kv_lo[r]:
            tiles[:grouped, 2:][tiles[:grouped, 2:] == r] = -1
            shared -= 1
        tiles[t, 0] = tiles[t, 2] = r
        tiles[t, 1] = kv_lo[r] = full[r] * block_size
        t += 1
    tiles[(tiles[:grouped, 2:] < 0).all(axis=1).nonzero()[0], 1] = 0  # a group whose every row took its own
    return CascadePlan(tiles, kv_lo, shared, len(long))

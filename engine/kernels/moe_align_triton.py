"""One Triton program that aligns a decode-sized step's (token, expert) pairs (engine/kernels/moe.py
``align``), where the torch formulation is a couple of dozen small kernels a sparse layer: at
batch 1 Qwen3-30B-A3B's 48 sparse layers ran ~1,600 kernels a token, and its decode took 8.85 ms a
token on an H100 (docs/perf.md, 2026-12-06), most of it launches' latency, not work.

The program holds every pair at once (``BLOCK_P`` ≥ N·k): it sorts the keys ``expert · P + pair``
(so each expert's pairs come out in pair order, as the stable argsort of the torch version gives
them), counts each expert's pairs, pads each run to a multiple of ``BLOCK_M`` and lays the runs
out expert by expert: the same slots, the same ``pair_ids`` and ``tile_expert`` as ``align``.
The per-expert figures go through a small scratch buffer in global memory (a vector in registers
cannot be indexed by another vector), with a barrier between its writes and reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._launch import CachedLauncher, pdl_entry

# the counts change with every step's size: a new one must not compile a kernel while serving
# (the block sizes do, but they take a handful of values, all met by a load's captures)
@triton.jit(do_not_specialize=["P", "E", "SLOTS", "TILES"])
def _align_kernel(experts_ptr, pair_ids_ptr, tile_expert_ptr, scratch_ptr, P, E, SLOTS, TILES,
                  BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                  BLOCK_M: tl.constexpr, SEARCH_STEPS: tl.constexpr, PDL: tl.constexpr):
    pdl_entry(PDL)
    i = tl.arange(0, BLOCK_P)
    live = i < P
    ex = tl.load(experts_ptr + i, mask=live, other=0).to(tl.int32)
    # each expert's pairs (the lanes past P counted as expert 0's, then taken off), its padded
    # run, where the run starts and where its first pair sits among the sorted ones
    e = tl.arange(0, BLOCK_E)
    counts = tl.histogram(ex, BLOCK_E) - tl.where(e == 0, BLOCK_P - P, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(scratch_ptr + e, ends - padded)
    tl.store(scratch_ptr + BLOCK_E + e, tl.cumsum(counts, axis=0) - counts)
    tl.store(scratch_ptr + 2 * BLOCK_E + e, ends)
    s = tl.arange(0, BLOCK_S)
    tl.store(pair_ids_ptr + s, P, mask=s < SLOTS)  # every slot padding until a pair lands in it
    tl.debug_barrier()
    # the pairs sorted by (expert, pair): a key's low part is its pair, its high part its expert
    srt = tl.sort(tl.where(live, ex * BLOCK_P + i, E * BLOCK_P))
    ok = srt < E * BLOCK_P
    se = tl.where(ok, srt // BLOCK_P, 0)
    dest = tl.load(scratch_ptr + se) + i - tl.load(scratch_ptr + BLOCK_E + se)
    tl.store(pair_ids_ptr + dest, srt % BLOCK_P, mask=ok)
    # each tile's expert: the first whose run ends past the tile's first slot (-1: past the last)
    t = tl.arange(0, BLOCK_T)
    first = t * BLOCK_M
    lo = t * 0
    hi = lo + E
    for _ in tl.static_range(SEARCH_STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        past = tl.load(scratch_ptr + 2 * BLOCK_E + mid, mask=active, other=0) > first
        hi = tl.where(active & past, mid, hi)
        lo = tl.where(active & (past == 0), mid + 1, lo)
    tl.store(tile_expert_ptr + t, tl.where(lo < E, lo, -1), mask=t < TILES)


_ALIGN_LAUNCH = CachedLauncher(_align_kernel, pdl=True)


def align_warps(pairs: int) -> int:
    """The warps of the one program: past 1,024 pairs, more threads to sort them."""
    return 4 if pairs <= 1024 else 8


def align_triton(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair_ids, tile_expert) of ``align`` for experts [N, k] (at most ``moe.MAX_ALIGN_PAIRS`` pairs)."""
    pairs = experts.numel()
    slots = -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m
    tiles = slots // block_m
    dev = experts.device
    pair_ids = torch.empty(slots, dtype=torch.int32, device=dev)
    tile_expert = torch.empty(tiles, dtype=torch.int32, device=dev)
    block_e = triton.next_power_of_2(num_experts)
    scratch = torch.empty(3 * block_e, dtype=torch.int32, device=dev)
    _ALIGN_LAUNCH.launch((1,), experts.reshape(-1), pair_ids, tile_expert, scratch, pairs, num_experts, slots, tiles,
                         BLOCK_P=max(16, triton.next_power_of_2(pairs)), BLOCK_E=block_e,
                         BLOCK_T=triton.next_power_of_2(tiles), BLOCK_S=triton.next_power_of_2(slots),
                         BLOCK_M=block_m, SEARCH_STEPS=num_experts.bit_length() + 1,
                         num_warps=align_warps(pairs))
    return pair_ids, tile_expert

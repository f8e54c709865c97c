"""Triton sampler: one program per row, a few streaming passes over the row, no sort, no host sync.

Passes (each reads the row's logits once; the later ones run only when the row needs them):
1. max and first argmax of the logits (greedy rows stop here);
2. rows with top-k or top-p: the z = logit / T of every token with p >= 2^-20 (p relative to the
   best token) are appended, in order, to a per-row candidate list of CANDIDATE_CAP entries;
3. top-k: the k-th largest z found exactly by a 17-ary search over the float's order-preserving
   int32 key (16 pivots counted per pass, <= 8 passes for 32 bits), over the candidates when
   there are at least k of them and they fit (they are the top tokens by z), else over the row;
4. top-p: ``Z = sum p`` (one pass), then the same search over the bits of p for the smallest
   threshold t with ``sum(p_v : p_v > t) < top_p * Z``; keeping ``p >= t`` is exactly the
   tie-widened sorted-prefix rule of the reference. When the candidates fit and hold at least
   the target mass, the threshold is >= 2^-20 and the search runs over them only;
5. the exponential race ``argmax p / -log(u)`` with u from the same uint32 hash as sample.py.
So a peaked distribution costs ~5 passes over the row plus cheap passes over a few thousand
candidates; a flat one falls back to whole-row searches and stays exact.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._launch import CachedLauncher, pdl_entry

NUM_PIVOTS = 16
CANDIDATE_CAP = 4096
CANDIDATE_P_BITS = 0x35800000  # float32 bits of 2**-20


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _order_key(z):
    # int32 key whose order is the float order: negative floats get their magnitude bits flipped
    bits = z.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _pivots(lo, hi, NP: tl.constexpr):
    i = tl.arange(0, NP).to(tl.int64) + 1
    return lo + ((hi - lo) * i) // (NP + 1)


@triton.jit
def _load_z(ptr, idx, valid, t, FROM_LOGITS: tl.constexpr):
    # z = logit / T straight from the row, or an already divided z from the candidate list
    x = tl.load(ptr + idx, mask=valid, other=float("-inf"))
    if FROM_LOGITS:
        x = x / t
    return x


@triton.jit
def _search_topk(ptr, n, t, lo, hi, k, FROM_LOGITS: tl.constexpr, BLOCK_P: tl.constexpr, NP: tl.constexpr):
    """Largest key t_k with count(key >= t_k) >= k over n values (invariant: lo passes, hi fails)."""
    offs = tl.arange(0, BLOCK_P)
    while hi - lo > 1:
        # pivots lie strictly inside (lo, hi), so they fit in int32 like the keys
        piv = _pivots(lo, hi, NP).to(tl.int32)
        cnt2 = tl.zeros([NP, BLOCK_P], tl.int32)  # reduced once after the sweep, not per tile
        for start in range(0, n, BLOCK_P):
            idx = start + offs
            valid = idx < n
            z = _load_z(ptr, idx, valid, t, FROM_LOGITS)
            cnt2 += ((_order_key(z)[None, :] >= piv[:, None]) & valid[None, :]).to(tl.int32)
        ok = tl.sum(cnt2, axis=1) >= k
        piv = piv.to(tl.int64)
        lo = tl.max(tl.where(ok, piv, lo), axis=0)
        hi = tl.min(tl.where(ok, hi, piv), axis=0)
    return lo


@triton.jit
def _search_topp(ptr, n, t, m, tk, plo, phi, target, FROM_LOGITS: tl.constexpr, BLOCK_P: tl.constexpr,
                 NP: tl.constexpr):
    """Smallest p-bits t_p with mass(p > t_p) < target (invariant: plo fails, phi passes)."""
    offs = tl.arange(0, BLOCK_P)
    while phi - plo > 1:
        piv = _pivots(plo, phi, NP).to(tl.int32)
        mass2 = tl.zeros([NP, BLOCK_P], tl.float32)
        for start in range(0, n, BLOCK_P):
            idx = start + offs
            valid = idx < n
            z = _load_z(ptr, idx, valid, t, FROM_LOGITS)
            p = tl.where(valid & (_order_key(z) >= tk), tl.exp(z - m), 0.0)
            mass2 += tl.where(p.to(tl.int32, bitcast=True)[None, :] > piv[:, None], p[None, :], 0.0)
        ok = tl.sum(mass2, axis=1) < target
        piv = piv.to(tl.int64)
        phi = tl.min(tl.where(ok, piv, phi), axis=0)
        plo = tl.max(tl.where(ok, plo, piv), axis=0)
    return phi


@triton.jit
def _sample_kernel(logits_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, step_ptr, out_ptr, cand_ptr,
                   keep_ptr, s_row, V, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, NP: tl.constexpr,
                   CAP: tl.constexpr, C_BITS: tl.constexpr, WRITE_KEEP: tl.constexpr, PDL: tl.constexpr):
    pdl_entry(PDL)
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * s_row
    cand = cand_ptr + row * CAP
    temp = tl.load(temp_ptr + row).to(tl.float32)
    greedy = temp <= 0.0
    t = tl.where(greedy, 1.0, temp)
    offs = tl.arange(0, BLOCK)

    # pass 1: max and its first index
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int64)
    for start in range(0, V, BLOCK):
        idx = start + offs
        x = tl.load(base + idx, mask=idx < V, other=float("-inf"))
        upd = x > best
        best = tl.where(upd, x, best)
        best_i = tl.where(upd, idx.to(tl.int64), best_i)
    mx = tl.max(best, axis=0)
    first = tl.min(tl.where(best == mx, best_i, V), axis=0)
    if greedy:
        tl.store(out_ptr + row, first)
    else:
        m = mx / t
        k = tl.load(topk_ptr + row)
        tp = tl.load(topp_ptr + row).to(tl.float32)
        k_on = (k > 0) & (k < V)
        p_on = tp < 1.0
        # candidates: z of the tokens with p >= 2^-20 (p relative to the best token), in order; when
        # they fit in CAP, the threshold searches below run over them instead of the whole row
        n_c = tl.full((), 0, tl.int32)
        if k_on | p_on:
            for start in range(0, V, BLOCK):
                idx = start + offs
                valid = idx < V
                z = tl.load(base + idx, mask=valid, other=float("-inf")) / t
                c = valid & (tl.exp(z - m).to(tl.int32, bitcast=True) >= C_BITS)
                pos = n_c + tl.cumsum(c.to(tl.int32), axis=0) - 1
                tl.store(cand + pos, z, mask=c & (pos < CAP))
                n_c += tl.sum(c.to(tl.int32), axis=0)
        fits = n_c <= CAP
        lo = tl.full((), -2147483648, tl.int64)
        if k_on:
            hi = _order_key(m).to(tl.int64) + 1
            # the candidates are the top n_c tokens by z: with n_c >= k the k-th largest is among them
            if fits & (n_c >= k):
                lo = _search_topk(cand, n_c, t, lo, hi, k, False, BLOCK_P, NP)
            else:
                lo = _search_topk(base, V, t, lo, hi, k, True, BLOCK_P, NP)
        tk = lo.to(tl.int32)
        p_lo = tl.full((), 0, tl.int32)
        if p_on:
            total = tl.zeros([BLOCK], tl.float32)
            for start in range(0, V, BLOCK):
                idx = start + offs
                valid = idx < V
                z = tl.load(base + idx, mask=valid, other=float("-inf")) / t
                total += tl.where(valid & (_order_key(z) >= tk), tl.exp(z - m), 0.0)
            target = tp * tl.sum(total, axis=0)
            phi = tl.full((), 0x3F800000, tl.int64)
            done = tl.full((), 0, tl.int32)
            if fits:
                cmass = tl.zeros([BLOCK_P], tl.float32)
                for start in range(0, n_c, BLOCK_P):
                    idx = start + tl.arange(0, BLOCK_P)
                    valid = idx < n_c
                    z = tl.load(cand + idx, mask=valid, other=float("-inf"))
                    cmass += tl.where(valid & (_order_key(z) >= tk), tl.exp(z - m), 0.0)
                # mass(p > C_BITS - 1) = candidate mass; if it reaches the target, C_BITS - 1 fails
                # the predicate and the threshold lies among the candidates
                if tl.sum(cmass, axis=0) >= target:
                    plo = tl.full((), C_BITS - 1, tl.int64)
                    phi = _search_topp(cand, n_c, t, m, tk, plo, phi, target, False, BLOCK_P, NP)
                    done = tl.full((), 1, tl.int32)
            if done == 0:
                plo = tl.full((), -1, tl.int64)
                phi = _search_topp(base, V, t, m, tk, plo, phi, target, True, BLOCK_P, NP)
            p_lo = phi.to(tl.int32)
        min_p = tl.load(minp_ptr + row).to(tl.float32)
        seed = tl.load(seed_ptr + row).to(tl.int64)
        step = tl.load(step_ptr + row).to(tl.int64)
        h = _mix32((seed & 0xFFFFFFFF).to(tl.uint32) ^ 0x9E3779B9)
        h = _mix32(h ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
        h = _mix32(h ^ (step & 0xFFFFFFFF).to(tl.uint32))
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_i = tl.zeros([BLOCK], tl.int64)
        for start in range(0, V, BLOCK):
            idx = start + offs
            valid = idx < V
            z = tl.load(base + idx, mask=valid, other=float("-inf")) / t
            p = tl.exp(z - m)
            keep = valid & (_order_key(z) >= tk) & (p.to(tl.int32, bitcast=True) >= p_lo) & (p >= min_p)
            if WRITE_KEEP:  # tests: the filtered set itself, not just the one token drawn from it
                tl.store(keep_ptr + row * V + idx, keep.to(tl.int8), mask=valid)
            hv = _mix32(h ^ idx.to(tl.uint32))
            u = ((hv >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
            score = tl.where(keep, p / -tl.log(u), -1.0)
            upd = score > best
            best = tl.where(upd, score, best)
            best_i = tl.where(upd, idx.to(tl.int64), best_i)
        top = tl.max(best, axis=0)
        tl.store(out_ptr + row, tl.min(tl.where(best == top, best_i, V), axis=0))


_SAMPLE_LAUNCH = CachedLauncher(_sample_kernel, pdl=True)


def sample_triton(logits, temperature, top_k, top_p, min_p, seeds, steps, out=None,
                  cap: int = CANDIDATE_CAP, keep_out: torch.Tensor | None = None) -> torch.Tensor:
    """See sample.sample. For tests: ``out`` (a poisoned buffer), ``cap`` (candidate list length, a
    power of two; small values force the whole-row fallback), ``keep_out`` ([B, V] int8, receives
    the filtered set of every non-greedy row)."""
    b, vocab = logits.shape
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        logits = logits.float().contiguous()
    if out is None:
        out = torch.empty(b, dtype=torch.int64, device=logits.device)
    # dtype conversions are device ops (no sync); no-ops when the caller already matches
    _SAMPLE_LAUNCH.launch((b,),
        logits, temperature.to(torch.float32), top_k.to(torch.int32), top_p.to(torch.float32),
        min_p.to(torch.float32), seeds.to(torch.int64), steps.to(torch.int64), out,
        torch.empty((b, cap), dtype=torch.float32, device=logits.device), out if keep_out is None else keep_out,
        logits.stride(0), vocab, BLOCK=2048 if vocab >= 2048 else triton.next_power_of_2(vocab),
        BLOCK_P=256 if vocab >= 256 else triton.next_power_of_2(vocab), NP=NUM_PIVOTS, CAP=cap, C_BITS=CANDIDATE_P_BITS,
        WRITE_KEEP=keep_out is not None, num_warps=8 if vocab >= 1024 else 4,
    )
    return out

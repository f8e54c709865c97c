"""Triton sampler: one program per row, a few streaming passes over the row, no sort, no host sync.

Passes (each reads the row's logits once; the later ones run only when the row needs them):
1. max and first argmax of the logits (greedy rows stop here);
2. top-k: the k-th largest ``z = logit / T`` found exactly by a 17-ary search over the float's
   order-preserving int32 key (16 pivots counted per pass, so <= 8 passes for 32 bits);
3. top-p: ``Z = sum p`` then the same search over the bits of p (p in [0, 1]) for the smallest
   threshold t with ``sum(p_v : p_v > t) < top_p * Z``; keeping ``p >= t`` is exactly the
   tie-widened sorted-prefix rule of the reference;
4. the exponential race ``argmax p / -log(u)`` with u from the same uint32 hash as sample.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_PIVOTS = 16


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
def _sample_kernel(logits_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, step_ptr, out_ptr,
                   s_row, V, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, NP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * s_row
    temp = tl.load(temp_ptr + row).to(tl.float32)
    greedy = temp <= 0.0
    t = tl.where(greedy, 1.0, temp)
    offs = tl.arange(0, BLOCK)
    offs_p = tl.arange(0, BLOCK_P)

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
        # top-k: largest key t_k with count(key >= t_k) >= k (invariant: lo passes, hi fails)
        lo = tl.full((), -2147483648, tl.int64)
        if (k > 0) & (k < V):
            hi = _order_key(m).to(tl.int64) + 1
            while hi - lo > 1:
                # pivots lie strictly inside (lo, hi), so they fit in int32 like the keys
                piv = _pivots(lo, hi, NP).to(tl.int32)
                cnt2 = tl.zeros([NP, BLOCK_P], tl.int32)  # reduced once after the sweep, not per tile
                for start in range(0, V, BLOCK_P):
                    idx = start + offs_p
                    valid = idx < V
                    z = tl.load(base + idx, mask=valid, other=float("-inf")) / t
                    hit = (_order_key(z)[None, :] >= piv[:, None]) & valid[None, :]
                    cnt2 += hit.to(tl.int32)
                ok = tl.sum(cnt2, axis=1) >= k
                piv = piv.to(tl.int64)
                lo = tl.max(tl.where(ok, piv, lo), axis=0)
                hi = tl.min(tl.where(ok, hi, piv), axis=0)
        tk = lo.to(tl.int32)
        tp = tl.load(topp_ptr + row).to(tl.float32)
        p_lo = tl.full((), 0, tl.int32)
        if tp < 1.0:
            total = tl.zeros([BLOCK], tl.float32)
            for start in range(0, V, BLOCK):
                idx = start + offs
                valid = idx < V
                z = tl.load(base + idx, mask=valid, other=float("-inf")) / t
                keep = valid & (_order_key(z) >= tk)
                total += tl.where(keep, tl.exp(z - m), 0.0)
            target = tp * tl.sum(total, axis=0)
            # smallest p-bits threshold t_p with mass(p > t_p) < target (invariant: lo fails, hi passes)
            plo = tl.full((), -1, tl.int64)
            phi = tl.full((), 0x3F800000, tl.int64)
            while phi - plo > 1:
                piv = _pivots(plo, phi, NP).to(tl.int32)
                mass2 = tl.zeros([NP, BLOCK_P], tl.float32)
                for start in range(0, V, BLOCK_P):
                    idx = start + offs_p
                    valid = idx < V
                    z = tl.load(base + idx, mask=valid, other=float("-inf")) / t
                    p = tl.where(valid & (_order_key(z) >= tk), tl.exp(z - m), 0.0)
                    pb = p.to(tl.int32, bitcast=True)
                    mass2 += tl.where(pb[None, :] > piv[:, None], p[None, :], 0.0)
                ok = tl.sum(mass2, axis=1) < target
                piv = piv.to(tl.int64)
                phi = tl.min(tl.where(ok, piv, phi), axis=0)
                plo = tl.max(tl.where(ok, plo, piv), axis=0)
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
            hv = _mix32(h ^ idx.to(tl.uint32))
            u = ((hv >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
            score = tl.where(keep, p / -tl.log(u), -1.0)
            upd = score > best
            best = tl.where(upd, score, best)
            best_i = tl.where(upd, idx.to(tl.int64), best_i)
        top = tl.max(best, axis=0)
        tl.store(out_ptr + row, tl.min(tl.where(best == top, best_i, V), axis=0))


def sample_triton(logits, temperature, top_k, top_p, min_p, seeds, steps, out=None) -> torch.Tensor:
    b, vocab = logits.shape
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        logits = logits.float().contiguous()
    if out is None:
        out = torch.empty(b, dtype=torch.int64, device=logits.device)
    # dtype conversions are device ops (no sync); no-ops when the caller already matches
    _sample_kernel[(b,)](
        logits, temperature.to(torch.float32), top_k.to(torch.int32), top_p.to(torch.float32),
        min_p.to(torch.float32), seeds.to(torch.int64), steps.to(torch.int64), out,
        logits.stride(0), vocab, BLOCK=2048 if vocab >= 2048 else triton.next_power_of_2(vocab),
        BLOCK_P=256 if vocab >= 256 else triton.next_power_of_2(vocab), NP=NUM_PIVOTS, num_warps=8 if vocab >= 1024 else 4,
    )
    return out

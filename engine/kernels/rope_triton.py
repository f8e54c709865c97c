"""Triton RoPE, in place on q and k: one program per token rotates all its q and k heads.

``INTERLEAVED`` (a constexpr): the pairs rotated together are the neighbours (2i, 2i + 1), not
(i, i + D/2); the cos/sin row is the same, only where the pair's halves come from differs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._launch import CachedLauncher, pdl_entry


@triton.jit
def _rotate(ptr, s_n, s_h, tok, cos, sin, H: tl.constexpr, HALF: tl.constexpr,
            BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    if INTERLEAVED:
        # pair i is (2i, 2i + 1): the heads' rows load whole and split into their even and odd
        # elements in registers. Addressed as two stride-2 halves, every element was a scalar
        # load and store of its own (sm_90, 40 heads: no vector access, 228 registers with
        # triton 3.6 against 48)
        c = tl.arange(0, 2 * BLOCK_HALF)[None, :]
        mask = (h < H) & (c < 2 * HALF)
        base = ptr + tok * s_n + h * s_h + c
        x = tl.load(base, mask=mask, other=0.0)
        x1, x2 = tl.split(tl.reshape(x, [BLOCK_H, BLOCK_HALF, 2]))
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        y = tl.join(a * cos - b * sin, b * cos + a * sin)
        tl.store(base, tl.reshape(y, [BLOCK_H, 2 * BLOCK_HALF]).to(x.dtype), mask=mask)
    else:  # pair i is (i, i + D/2)
        d = tl.arange(0, BLOCK_HALF)[None, :]
        mask = (h < H) & (d < HALF)
        base = ptr + tok * s_n + h * s_h + d
        x1 = tl.load(base, mask=mask, other=0.0)
        x2 = tl.load(base + HALF, mask=mask, other=0.0)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(base, (a * cos - b * sin).to(x1.dtype), mask=mask)
        tl.store(base + HALF, (b * cos + a * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cs_ptr, s_qn, s_qh, s_kn, s_kh, s_cs,
                 HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
                 PDL: tl.constexpr):
    pdl_entry(PDL)
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    dm = d < HALF
    cos = tl.load(cs_ptr + pos * s_cs + d, mask=dm, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * s_cs + HALF + d, mask=dm, other=0.0).to(tl.float32)
    _rotate(q_ptr, s_qn, s_qh, tok, cos, sin, HQ, HALF, BLOCK_HQ, BLOCK_HALF, INTERLEAVED)
    _rotate(k_ptr, s_kn, s_kh, tok, cos, sin, HK, HALF, BLOCK_HK, BLOCK_HALF, INTERLEAVED)


_ROPE_LAUNCH = CachedLauncher(_rope_kernel, pdl=True)


def apply_rope_triton(q, k, positions, cos_sin_cache, interleaved: bool = False) -> None:
    n, hq, d = q.shape
    hk = k.shape[1]
    half = d // 2
    cs = cos_sin_cache if cos_sin_cache.stride(1) == 1 else cos_sin_cache.contiguous()
    bhalf = triton.next_power_of_2(half)
    _ROPE_LAUNCH.launch((n,), q, k, positions, cs, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cs.stride(0),
                       HQ=hq, HK=hk, HALF=half, BLOCK_HQ=triton.next_power_of_2(hq),
                       BLOCK_HK=triton.next_power_of_2(hk), BLOCK_HALF=bhalf, INTERLEAVED=interleaved,
                       num_warps=4 if hq * half >= 2048 else 1)

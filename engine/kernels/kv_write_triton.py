"""Triton KV write: one program per new token copies all its KV heads into the token's slot."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._launch import CachedLauncher, pdl_entry
from engine.kernels.fp8_format import FP8
from engine.kernels.fp8_triton import E4M3_MAX_C


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                     s_kn, s_kh, s_vn, s_vh,
                     s_kcp, s_kcb, s_kch, s_vcp, s_vcb, s_vch,
                     H: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8_CACHE: tl.constexpr, PDL: tl.constexpr):
    pdl_entry(PDL)
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        page = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < H) & (d < D)
        src = tok.to(tl.int64)
        kv = tl.load(k_ptr + src * s_kn + h * s_kh + d, mask=mask)
        vv = tl.load(v_ptr + src * s_vn + h * s_vh + d, mask=mask)
        if FP8_CACHE:  # e4m3 at unit scale, saturated
            kv = tl.clamp(kv.to(tl.float32), -E4M3_MAX_C, E4M3_MAX_C)
            vv = tl.clamp(vv.to(tl.float32), -E4M3_MAX_C, E4M3_MAX_C)
        tl.store(kc_ptr + page * s_kcp + off * s_kcb + h * s_kch + d, kv.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + page * s_vcp + off * s_vcb + h * s_vch + d, vv.to(vc_ptr.dtype.element_ty), mask=mask)


_KV_WRITE_LAUNCH = CachedLauncher(_kv_write_kernel, pdl=True)


def write_kv_triton(k, v, k_cache, v_cache, slot_mapping) -> None:
    n, h, d = k.shape
    # the kernel indexes the last dim with unit stride
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("KV cache views need a contiguous head_dim")
    block_h, block_d = triton.next_power_of_2(h), triton.next_power_of_2(d)
    _KV_WRITE_LAUNCH.launch((n,),
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        H=h, D=d, BLOCK_SIZE=k_cache.shape[1], BLOCK_H=block_h, BLOCK_D=block_d, FP8_CACHE=k_cache.dtype == FP8,
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )

"""Write the new tokens' K and V into the paged cache.

Cache views are ``[num_pages, block_size, num_kv_heads, head_dim]`` with arbitrary strides (the
page stride is usually a whole multi-layer page of a shared pool). ``slot = page * block_size +
offset``; slot ``-1`` is padding and writes nothing. An e4m3 cache (``kv_cache_dtype="fp8"``)
stores each element at unit scale, saturated to +-448.
"""

from __future__ import annotations

import torch

from engine.kernels._dispatch import check, use_triton
from engine.kernels.fp8_format import E4M3_MAX, FP8


def _validate(k, v, k_cache, v_cache, slot_mapping) -> None:
    check(k.dim() == 3 and v.shape == k.shape, f"k/v must be [N, Hkv, D] and equal, got {tuple(k.shape)} {tuple(v.shape)}")
    check(k_cache.dim() == 4 and v_cache.shape == k_cache.shape, "k_cache/v_cache must be [pages, block, Hkv, D] and equal")
    check(k_cache.shape[2:] == k.shape[1:], f"cache heads/dim {tuple(k_cache.shape[2:])} != k {tuple(k.shape[1:])}")
    check(slot_mapping.dim() == 1 and slot_mapping.shape[0] == k.shape[0], "slot_mapping must be [N]")
    check(k_cache.dtype == v_cache.dtype and k.dtype == v.dtype and k_cache.dtype in (k.dtype, FP8),
          f"dtype mismatch {k.dtype} vs cache {k_cache.dtype}")


def write_kv_ref(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Torch reference: scatter rows of k/v into the cache slots (in place)."""
    slots = slot_mapping.to(torch.int64)
    valid = slots >= 0
    bs = k_cache.shape[1]
    s = slots[valid]
    page, off = s // bs, s % bs
    if k_cache.dtype == FP8:
        k, v = k.float().clamp(-E4M3_MAX, E4M3_MAX), v.float().clamp(-E4M3_MAX, E4M3_MAX)
    k_cache[page, off] = k[valid].to(k_cache.dtype)
    v_cache[page, off] = v[valid].to(v_cache.dtype)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k[N,Hkv,D], v[N,Hkv,D] into the paged caches at slot_mapping[N] (-1 = skip)."""
    _validate(k, v, k_cache, v_cache, slot_mapping)
    if k.shape[0] == 0:
        return
    if use_triton(k, k_cache, slot_mapping):
        from engine.kernels.kv_write_triton import write_kv_triton

        write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        write_kv_ref(k, v, k_cache, v_cache, slot_mapping)

"""Paged attention over the KV cache: varlen queries with cached context, causal, GQA.

Metadata (docs/architecture.md): new tokens are flattened sequence after sequence;
``query_start_loc[B+1]`` are their cu_seqlens, ``seq_lens[B]`` the context length after this
step, ``block_tables[B, max_pages]`` page ids. New token j of sequence b sits at position
``seq_lens[b] - q_len_b + j`` and attends to positions ``0 ..= that``. The cache already holds
the new tokens' K/V. Query head h reads KV head ``h // (Hq // Hkv)``. The cache is in q's dtype
or e4m3 at unit scale (``kv_cache_dtype="fp8"``: the kernels widen each K/V tile as they load it).

Cascade (optional, ``cascade=(tiles, kv_lo)``, a plan of engine/runner/cascade.py): one-token
queries whose tables begin with the same pages read that shared prefix once per tile of rows.
``tiles[T, 2 + R]`` int32: a row of the group whose table holds the shared pages, the shared
length in tokens (0: an unused tile), then up to R batch rows (-1: none); ``kv_lo[B]`` int32
is each row's shared length (0 outside the plan). The result is the same attention — the plan
only decides who reads what — so the reference ignores it.
"""

from __future__ import annotations

import torch

from engine.kernels._dispatch import check, use_triton


def _validate(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables) -> None:
    check(q.dim() == 3, f"q must be [N, Hq, D], got {tuple(q.shape)}")
    check(k_cache.dim() == 4 and v_cache.shape == k_cache.shape, "caches must be [pages, block, Hkv, D] and equal")
    check(k_cache.shape[3] == q.shape[2], f"head_dim {q.shape[2]} != cache head_dim {k_cache.shape[3]}")
    check(q.shape[1] % k_cache.shape[2] == 0, f"Hq {q.shape[1]} is not a multiple of Hkv {k_cache.shape[2]}")
    b = seq_lens.shape[0]
    check(query_start_loc.shape == (b + 1,), f"query_start_loc must be [B+1] = [{b + 1}]")
    check(block_tables.dim() == 2 and block_tables.shape[0] == b, "block_tables must be [B, max_pages]")
    check(k_cache.stride(3) == 1 and q.stride(2) == 1, "q and the caches need a contiguous head_dim")
    check(k_cache.dtype == v_cache.dtype and k_cache.dtype in (q.dtype, torch.float8_e4m3fn),
          f"caches must be of q's dtype {q.dtype} or float8_e4m3fn, got {k_cache.dtype}")


def paged_attention_ref(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale):
    """Torch reference, one sequence at a time, float32 math."""
    n, hq, d = q.shape
    hkv = k_cache.shape[2]
    bs = k_cache.shape[1]
    group = hq // hkv
    out = torch.zeros(n, hq, d, dtype=q.dtype, device=q.device)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        s, e = starts[b], starts[b + 1]
        ql = e - s
        if ql == 0:
            continue
        npages = (seq_len + bs - 1) // bs
        pages = block_tables[b, :npages].to(torch.int64)
        kk = k_cache[pages].reshape(npages * bs, hkv, d)[:seq_len].float()
        vv = v_cache[pages].reshape(npages * bs, hkv, d)[:seq_len].float()
        kk = kk.repeat_interleave(group, dim=1)  # [L, Hq, D]
        vv = vv.repeat_interleave(group, dim=1)
        qq = q[s:e].float()  # [ql, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        qpos = torch.arange(seq_len - ql, seq_len, device=q.device)
        kpos = torch.arange(seq_len, device=q.device)
        mask = kpos[None, :] <= qpos[:, None]
        scores = scores.masked_fill(~mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[s:e] = torch.einsum("hqk,khd->qhd", probs, vv).to(q.dtype)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float, max_query_len: int, max_seq_len: int,
                    cascade: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention of q[N,Hq,D] over the paged cache; returns out[N,Hq,D] in q.dtype.

    ``max_query_len`` and ``max_seq_len`` are host ints bounding the batch (they size the grid, so
    no device value is read on the host); they must not be below the true maxima. ``cascade``:
    a plan's (tiles, kv_lo), see the module docstring.
    """
    _validate(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    if cascade is not None:
        tiles, kv_lo = cascade
        check(tiles.dim() == 2 and tiles.shape[1] >= 3 and tiles.dtype == torch.int32,
              f"cascade tiles must be [T, 2 + R] int32, got {tuple(tiles.shape)} {tiles.dtype}")
        check(kv_lo.shape == seq_lens.shape and kv_lo.dtype == torch.int32, "kv_lo must be [B] int32")
    if q.shape[0] == 0:
        return torch.empty_like(q)
    if use_triton(q, k_cache, query_start_loc, seq_lens, block_tables):
        from engine.kernels.attention_triton import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                                      scale, max_query_len, max_seq_len, cascade=cascade)
    return paged_attention_ref(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale)

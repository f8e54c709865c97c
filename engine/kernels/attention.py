"""Paged attention over the KV cache: varlen queries with cached context, causal, GQA, optionally
chunked local.

Metadata (docs/architecture.md): new tokens are flattened sequence after sequence;
``query_start_loc[B+1]`` are their cu_seqlens, ``seq_lens[B]`` the context length after this
step, ``block_tables[B, max_pages]`` page ids. New token j of sequence b sits at position
``seq_lens[b] - q_len_b + j`` and attends to positions ``0 ..= that``. The cache already holds
the new tokens' K/V. Query head h reads KV head ``h // (Hq // Hkv)``. The cache is in q's dtype
or e4m3 at unit scale (``kv_cache_dtype="fp8"``: the kernels widen each K/V tile as they load it).

Chunked local attention (``chunk`` > 0, a layer of a model with ``attention_chunk_size``): the
token at position p attends to positions ``(p // chunk) * chunk ..= p`` only, causal attention
inside its own chunk of the sequence. The kernels read no key below a row's chunk, so a 32k
prompt in 8k chunks scores a quarter of the (query, key) pairs of causal attention. ``chunk=0``:
ordinary causal attention.

Cascade (optional, ``cascade=(tiles, kv_lo)``, a plan of engine/runner/cascade.py): one-token
queries whose tables begin with the same pages read that shared prefix once per tile of rows.
``tiles[T, 2 + R]`` int32: a row of the group whose table holds the shared pages, the shared
length in tokens (0: an unused tile), then up to R batch rows (-1: none); ``kv_lo[B]`` int32
is each row's shared length (0 outside the plan). The result is the same attention — the plan
only decides who reads what — so the reference ignores it. A plan reads the shared pages for
every row, which a chunked row may not see: ``paged_attention`` refuses a plan with ``chunk``
> 0 (a model passes none in its chunked layers).
"""

from __future__ import annotations

import torch

from engine.kernels._dispatch import check, use_triton


def _validate(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, chunk) -> None:
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
    check(isinstance(chunk, int) and chunk >= 0, f"chunk must be an int >= 0 (0: not chunked), got {chunk!r}")


def paged_attention_ref(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, chunk: int = 0):
    """Torch reference, one sequence at a time, float32 math; ``chunk``: see the module docstring."""
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
        if chunk > 0:
            mask &= kpos[None, :] >= (qpos[:, None] // chunk) * chunk
        scores = scores.masked_fill(~mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[s:e] = torch.einsum("hqk,khd->qhd", probs, vv).to(q.dtype)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float, max_query_len: int, max_seq_len: int,
                    cascade: tuple[torch.Tensor, torch.Tensor] | None = None, chunk: int = 0) -> torch.Tensor:
    """Attention of q[N,Hq,D] over the paged cache; returns out[N,Hq,D] in q.dtype.

    ``max_query_len`` and ``max_seq_len`` are host ints bounding the batch (they size the grid, so
    no device value is read on the host); they must not be below the true maxima. ``cascade``:
    a plan's (tiles, kv_lo), see the module docstring. ``chunk``: the chunk size of chunked local
    attention (0: causal over the whole sequence); a ``cascade`` plan with ``chunk`` > 0 is a
    KernelError.
    """
    _validate(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, chunk)
    check(cascade is None or chunk == 0, "a cascade plan reads shared pages a chunked row may not see: "
                                         "pass cascade=None with chunk > 0")
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
                                      scale, max_query_len, max_seq_len, cascade=cascade, chunk=chunk)
    return paged_attention_ref(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, chunk=chunk)

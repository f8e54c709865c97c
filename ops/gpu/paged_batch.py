"""One attention batch over a paged cache as the engine lays it out, for the attention benches
(kernel_bench.py, prefill_bench.py, long_rows_bench.py): Llama-3.1-8B's heads, bfloat16, 16-token pages of a
two-layer pool (so pages are strided), each sequence's pages shuffled over the pool."""

from __future__ import annotations

import torch

HQ, HKV, D, BLOCK = 32, 8, 128, 16


def paged_batch(q_lens: list[int], seq_lens: list[int], gen: torch.Generator | None = None, device: str = "cuda",
                dtype: torch.dtype = torch.bfloat16):
    """(q [sum(q_lens), HQ, D], k_cache, v_cache, query_start_loc, seq_lens, block_tables); ``gen``
    None: torch's default generator."""
    pages = sum((s + BLOCK - 1) // BLOCK for s in seq_lens) + 4
    pool = torch.randn(pages, 2, 2, BLOCK, HKV, D, device=device, dtype=dtype, generator=gen)
    kc, vc = pool[:, 1, 0], pool[:, 1, 1]
    width = max((s + BLOCK - 1) // BLOCK for s in seq_lens)
    perm = torch.randperm(pages, device=device, generator=gen).to(torch.int32)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32, device=device)
    used = 0
    for i, s in enumerate(seq_lens):
        n = (s + BLOCK - 1) // BLOCK
        tables[i, :n] = perm[used:used + n]
        used += n
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), HQ, D, device=device, dtype=dtype, generator=gen)
    return q, kc, vc, qsl, sl, tables

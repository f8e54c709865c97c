"""One layer's decode attention at the 8B's shapes with and without a cascade plan: rows forking
from a few shared prompts (the shared-system workload's shape), each variant replayed from a CUDA
graph (triton.testing.do_bench_cudagraph), the cascade kernel also timed alone.

    . ops/gpu/env.sh; python3 ops/gpu/cascade_probe.py $OUT/cascade_probe.json

(or as the `probe` part of ops/gpu/prefix_cache.sh, beside the workloads)
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from triton.testing import do_bench_cudagraph

from engine.kernels import attention_triton as att
from engine.runner.cascade import max_tiles, plan_cascade, rows_per_tile
from ops.bench.engine_bench import _commit

HQ, HKV, D, BS = 32, 8, 128, 16


def _batch(rows: int, groups: int, shared_pages: int, own_tokens: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    trunks = [np.arange(1 + k * shared_pages, 1 + (k + 1) * shared_pages) for k in range(max(groups, 1))]
    nxt = 1 + max(groups, 1) * shared_pages
    tables, lens = [], []
    for i in range(rows):
        own = int(rng.integers(own_tokens // 2, own_tokens * 3 // 2))
        own_pages = -(-own // BS)
        pages = np.concatenate([trunks[i % groups] if groups else np.zeros(0, np.int64),
                                np.arange(nxt, nxt + own_pages)])
        nxt += own_pages
        tables.append(pages)
        lens.append((shared_pages if groups else 0) * BS + own)
    width = max(map(len, tables))
    bt = np.zeros((rows, width), dtype=np.int32)
    for i, p in enumerate(tables):
        bt[i, :len(p)] = p
    return bt, np.asarray(lens, dtype=np.int64), nxt


def main() -> int:
    out_path = sys.argv[1]
    dev = torch.device("cuda")
    results = []
    for rows, groups, shared_pages, own in ((96, 4, 64, 300), (192, 4, 64, 300), (200, 0, 0, 1300), (32, 2, 64, 300)):
        bt, lens, pages = _batch(rows, groups, shared_pages, own)
        per_tile = rows_per_tile(HQ, HKV)
        tiles, kv_lo, planned = plan_cascade(bt, lens, np.ones(rows), BS, per_tile, max_tiles(rows, per_tile))
        g = torch.Generator(device=dev).manual_seed(0)
        kc = torch.randn(pages, BS, HKV, D, device=dev, generator=g, dtype=torch.bfloat16)
        vc = torch.randn(pages, BS, HKV, D, device=dev, generator=g, dtype=torch.bfloat16)
        q = torch.randn(rows, HQ, D, device=dev, generator=g, dtype=torch.bfloat16)
        qsl = torch.arange(rows + 1, dtype=torch.int32, device=dev)
        sl = torch.from_numpy(lens.astype(np.int32)).to(dev)
        btd = torch.from_numpy(bt).to(dev)
        casc = (torch.from_numpy(tiles).to(dev), torch.from_numpy(kv_lo).to(dev))
        out = torch.empty_like(q)
        row = {"rows": rows, "groups": groups, "shared_tokens": shared_pages * BS, "own_tokens_mean": own,
               "planned_rows": planned}
        for name, c in (("plain", None), ("cascade", casc)):
            fn = lambda c=c: att.paged_attention_triton(q, kc, vc, qsl, sl, btd, 0.088, 1, 4096, out=out, cascade=c)
            fn()
            row[f"{name}_us"] = do_bench_cudagraph(fn, rep=200) * 1e3
        if planned:
            common = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
                      vc.stride(0), vc.stride(1), vc.stride(2), btd.stride(0), 0.088 * att.LOG2E)
            fn = lambda: att._cascade(q, kc, vc, qsl, btd, casc[0], common, rows, HQ, HKV, HQ // HKV, D, D, "tf32", False)
            fn()
            row["cascade_kernel_us"] = do_bench_cudagraph(fn, rep=200) * 1e3
        kv_bytes = int(lens.sum()) * HKV * D * 2 * 2
        row["plain_tb_s"] = kv_bytes / row["plain_us"] / 1e6
        print(row, flush=True)
        results.append(row)
    json.dump({"commit": _commit(), "gpu": torch.cuda.get_device_name(), "rows": results}, open(out_path, "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

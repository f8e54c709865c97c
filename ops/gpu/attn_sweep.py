"""Decode attention alone, bf16 vs e4m3 KV cache, over launch shapes: one 8B layer's paged
attention (32 q heads, 8 KV heads, head_dim 128, 16-token pages scattered over the pool) at
serving batch sizes, each call replayed from a CUDA graph (fp8_bench.graph_ms). An e4m3 page is
half a bf16 one: the kernel should take about half the time where it is bandwidth-bound.

    . ops/gpu/env.sh; python3 ops/gpu/attn_sweep.py $OUT/attn_sweep.json
"""

from __future__ import annotations

import itertools
import json
import sys

import torch

from engine.kernels.attention_triton import paged_attention_triton
from engine.kernels.fp8_format import FP8
from ops.bench.engine_bench import _commit
from ops.gpu.fp8_bench import graph_ms

CASES = ((256, 400), (512, 300), (128, 600), (64, 1000), (8, 1500), (1, 400))
SHAPES = [dict(block_n=bn, num_warps=w, num_stages=s) for bn, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3, 4))]


def main() -> int:
    out = sys.argv[1]
    dev = torch.device("cuda")
    hq, hkv, d, bs = 32, 8, 128, 16
    res: dict = {"commit": _commit(), "gpu": torch.cuda.get_device_name(), "rows": []}
    for b, ctx in CASES:
        pages_per = -(-(ctx + 1) // bs)
        n_pages = b * pages_per + 8
        perm = torch.randperm(n_pages, device=dev, dtype=torch.int32)[: b * pages_per].view(b, pages_per)
        q = torch.randn(b, hq, d, dtype=torch.bfloat16, device=dev)
        qsl = torch.arange(b + 1, dtype=torch.int32, device=dev)
        lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
        kb = torch.randn(n_pages, bs, hkv, d, dtype=torch.bfloat16, device=dev)
        vb = torch.randn(n_pages, bs, hkv, d, dtype=torch.bfloat16, device=dev)
        caches = {"bf16": (kb, vb), "fp8": (kb.to(FP8), vb.to(FP8))}
        gb = b * ctx * hkv * d * 2 * 2 / 1e9  # K and V bytes read per call (bf16)
        for kind, (kc, vc) in caches.items():
            ref = paged_attention_triton(q, kc, vc, qsl, lens, perm, 0.088, 1, ctx)
            rows = []
            for cfg in SHAPES:
                try:
                    o = paged_attention_triton(q, kc, vc, qsl, lens, perm, 0.088, 1, ctx, config=cfg)
                    err = (o.float() - ref.float()).abs().max().item()
                    us = 1e3 * graph_ms(lambda: paged_attention_triton(q, kc, vc, qsl, lens, perm, 0.088, 1, ctx,
                                                                       config=cfg))
                except Exception as e:  # a shape out of resources: reported, not fatal
                    rows.append({**cfg, "error": str(e)[:200]})
                    continue
                rows.append({**cfg, "us": us, "max_err_vs_default": err})
            default_us = 1e3 * graph_ms(lambda: paged_attention_triton(q, kc, vc, qsl, lens, perm, 0.088, 1, ctx))
            best = min((r for r in rows if "us" in r), key=lambda r: r["us"])
            gbytes = gb / (2 if kind == "fp8" else 1)
            row = {"batch": b, "ctx": ctx, "kv": kind, "default_us": default_us, "best": best,
                   "default_tb_s": gbytes / default_us * 1e6 / 1e3, "best_tb_s": gbytes / best["us"] * 1e6 / 1e3,
                   "all": rows}
            res["rows"].append(row)
            print(f"B={b} ctx={ctx} {kind}: default {default_us:.1f} us ({row['default_tb_s']:.2f} TB/s), best "
                  f"{best['us']:.1f} us ({row['best_tb_s']:.2f} TB/s) {dict((k, best[k]) for k in ('block_n', 'num_warps', 'num_stages'))}",
                  flush=True)
        del caches, kb, vb
        torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

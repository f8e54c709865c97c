"""Prefill attention at long contexts: the engine's paged kernel against torch's flash backend.

Usage: ``python ops/gpu/prefill_bench.py [--tree DIR] [--label NAME] [--sweep] [--kv-dtype fp8] [--out FILE]``.
Llama-3.1-8B's heads (32 query, 8 KV, head_dim 128), bfloat16, a 16-token paged cache whose pages
are shuffled (the engine's layout: a two-layer pool, so pages are strided). Shapes: whole causal
prompts of 4k-128k tokens (one sequence), 4 x 2k (the kernel table's old row), and chunks of 512,
1k and 4k tokens at 32k (and 4k at 120k) of context (chunked prefill reading earlier chunks from
pages; the small ones are where ``prefill_shape`` switches to 64-row tiles).

For whole prompts the same numbers go through ``F.scaled_dot_product_attention`` with only the
flash backend enabled (K/V expanded to 32 heads, contiguous ``[1, H, S, D]``: its best case; an
e4m3 cache, ``--kv-dtype fp8``, widened to bfloat16 for it),
and the engine's output is compared with it. ``--sweep`` also times launch shapes (BLOCK_M,
BLOCK_N, warps, stages) at 8k and 32k. ``--tree`` imports ``engine`` from another checkout (an
A/B in one device run: ``git archive REV | tar -x -C DIR``). TFLOP/s counts causal work only:
4 * heads * head_dim * (q_len * context + q_len * (q_len + 1) / 2).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("--tree", default=str(Path(__file__).resolve().parents[2]))
ap.add_argument("--label", default="this tree")
ap.add_argument("--sweep", action="store_true")
ap.add_argument("--max-len", type=int, default=131072)
ap.add_argument("--kv-dtype", choices=["auto", "fp8"], default="auto",
                help="fp8: the cache in e4m3 (the kernel's float16 dots; flash reads it widened to bf16)")
ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "prefill_bench.json"))
args = ap.parse_args()
sys.path.insert(0, str(Path(args.tree).resolve()))

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from engine.kernels.attention_triton import paged_attention_triton  # noqa: E402
from paged_batch import BLOCK, D, HKV, HQ, paged_batch  # noqa: E402 - a sibling (run as a script)

DEV = "cuda"
SWEEP = tuple(dict(zip(("block_m", "block_n", "num_warps", "num_stages"), c)) for c in (
    (256, 128, 8, 2), (256, 128, 8, 3), (256, 64, 8, 3), (256, 64, 8, 4), (128, 128, 8, 3), (64, 64, 4, 3)))


def flops(q_lens, seq_lens) -> float:
    return sum(4 * HQ * D * (ql * (s - ql) + ql * (ql + 1) / 2) for ql, s in zip(q_lens, seq_lens))


def ms_of(fn) -> float:
    return float(do_bench(fn, warmup=25, rep=150, return_mode="median"))


def contiguous_kv(kc, vc, tables, s):
    """The sequence's K and V out of the pages, [1, HQ, s, D] each (GQA expanded)."""
    pages = tables[0, :(s + BLOCK - 1) // BLOCK].long()
    k = kc[pages].to(torch.bfloat16).reshape(-1, HKV, D)[:s].transpose(0, 1).repeat_interleave(HQ // HKV, 0)
    v = vc[pages].to(torch.bfloat16).reshape(-1, HKV, D)[:s].transpose(0, 1).repeat_interleave(HQ // HKV, 0)
    return k.unsqueeze(0).contiguous(), v.unsqueeze(0).contiguous()


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows = []
    shapes = [(f"prompt {s // 1024}k", [s], [s]) for s in (4096, 8192, 16384, 32768, 65536, 131072)
              if s <= args.max_len]
    shapes += [("4 x 2k", [2048] * 4, [2048] * 4), ("chunk 512 at 32k", [512], [32768 + 512]),
               ("chunk 1k at 32k", [1024], [32768 + 1024]), ("chunk 4k at 32k", [4096], [32768 + 4096]),
               ("chunk 4k at 120k", [4096], [120000 + 4096])]
    for name, q_lens, seq_lens in shapes:
        if max(seq_lens) > args.max_len + 4096:
            continue
        q, kc, vc, qsl, sl, tables = paged_batch(q_lens, seq_lens, gen)
        if args.kv_dtype == "fp8":
            kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
        call = (q, kc, vc, qsl, sl, tables, 1 / math.sqrt(D), max(q_lens), max(seq_lens))
        f = flops(q_lens, seq_lens)
        base = paged_attention_triton(*call)
        torch.cuda.synchronize()
        configs = [{}] + (list(SWEEP) if args.sweep and name in ("prompt 8k", "prompt 32k", "chunk 512 at 32k",
                                                                   "chunk 1k at 32k") else [])
        for cfg in configs:
            row = {"tree": args.label, "shape": name, "q_lens": q_lens, "seq_lens": seq_lens, "kernel": "paged",
                   "kv_dtype": args.kv_dtype,
                   "config": cfg}
            try:
                out = paged_attention_triton(*call, config=cfg)
                ms = ms_of(lambda: paged_attention_triton(*call, config=cfg))
                row.update(ms=ms, tflops=f / ms / 1e9, rel_vs_default=rel(out, base))
            except Exception as e:  # one launch shape that does not compile must not end the run
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
        if len(q_lens) == 1 and q_lens[0] == seq_lens[0]:
            s = seq_lens[0]
            k, v = contiguous_kv(kc, vc, tables, s)
            qq = q.transpose(0, 1).unsqueeze(0).contiguous()
            row = {"tree": args.label, "shape": name, "q_lens": q_lens, "seq_lens": seq_lens, "kernel": "sdpa flash"}
            try:
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    ref = torch.nn.functional.scaled_dot_product_attention(qq, k, v, is_causal=True)
                    ms = ms_of(lambda: torch.nn.functional.scaled_dot_product_attention(qq, k, v, is_causal=True))
                row.update(ms=ms, tflops=f / ms / 1e9, paged_rel_vs_sdpa=rel(base, ref[0].transpose(0, 1)))
            except Exception:
                row["error"] = traceback.format_exc()[-400:]
            rows.append(row)
            print(json.dumps(row), flush=True)
            del k, v, qq
        del q, kc, vc, tables, base
        torch.cuda.empty_cache()
    prior = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {"rows": []}
    prior["rows"] += rows
    prior.setdefault("device", torch.cuda.get_device_name())
    prior.setdefault("torch", torch.__version__)
    Path(args.out).write_text(json.dumps(prior, indent=1))
    print(f"\n{'tree':<12} {'shape':<18} {'kernel':<11} {'config':<44} {'ms':>9} {'TFLOP/s':>8}")
    for r in rows:
        cfg = ",".join(f"{k}={v}" for k, v in r.get("config", {}).items())
        print(f"{r['tree']:<12} {r['shape']:<18} {r['kernel']:<11} {cfg:<44} {r.get('ms', float('nan')):>9.3f} "
              f"{r.get('tflops', float('nan')):>8.1f} {r.get('error', '')[:60]}")


if __name__ == "__main__":
    main()

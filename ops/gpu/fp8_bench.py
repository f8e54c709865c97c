"""FP8 GEMMs of Llama-3.1-8B's linears on the GPU: bf16 cuBLAS, cuBLASLt's row-wise FP8
(``torch._scaled_mm``) and the few-rows Triton kernel over a sweep of launch shapes, at a few
rows; then the whole set of one decode step's linears (32 layers, bf16 LM head) with the engine's
choices, each as a CUDA graph. Prints a table last, writes JSON.

    python ops/gpu/fp8_bench.py [out.json]
    python ops/gpu/fp8_bench.py --medium [out.json]     (32-128 rows: the kernel tiled over rows vs cuBLASLt)
    python ops/gpu/fp8_bench.py --one-row [out.json]    (one row: 16-channel tiles too, and a step's linears)
    python ops/gpu/fp8_bench.py --parts [out.json]      (one FP8 decoder layer's kernels beside bf16's)

Achieved GB/s is the weight bytes over the time (the floor a decode step of a few rows has).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from engine.kernels import activation, fp8, norm  # noqa: E402
from engine.kernels.fp8_triton import fp8_linear_small_m, small_m_config  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 4, 16)
SWEEP = [dict(block_n=bn, block_k=bk, split_k=sk, num_warps=w, num_stages=st)
         for bn, bk, sk, w, st in itertools.product((32, 64, 128), (128, 256, 512), (1, 2, 4, 8), (4,), (3, 5))]
# Medium rows (--medium): the kernel tiled over rows too, against cuBLASLt, where cuBLASLt's FP8
# falls behind its bf16 (--parts: the down projection at 64 rows).
# 256 and 512 rows (decode batches of the c200 and offline runs): 128-row tiles with 8 warps, and
# split K (the down projection's K = 14336 over 64 programs leaves most SMs idle); 256-channel
# tiles spill (sm_90 AOT: 255 registers and 200 bytes of stack).
MEDIUM_ROWS = (32, 64, 128, 256, 512)
MEDIUM_SWEEP = ([dict(block_m=bm, block_n=bn, block_k=bk, split_k=1, num_warps=4, num_stages=st)
                 for bm, bn, bk, st in itertools.product((32, 64, 128), (32, 64, 128), (128, 256), (3, 4))]
                + [dict(block_m=128, block_n=bn, block_k=128, split_k=sk, num_warps=8, num_stages=st)
                   for bn, sk, st in itertools.product((128,), (1, 2, 4), (3, 4))])


def medium(res: dict) -> None:
    dev = "cuda"
    out: dict = {}
    for name, (n, k) in SHAPES.items():
        w_q, w_s = fp8.quantize_weight(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02)
        for m in MEDIUM_ROWS:
            a = fp8.quantize_rows(torch.randn(m, k, device=dev, dtype=torch.bfloat16))
            lt = graph_ms(lambda: torch._scaled_mm(a.q, w_q.t(), scale_a=a.scale, scale_b=w_s.view(1, -1),
                                                   out_dtype=torch.bfloat16))
            # the same GEMM without the periodic float32 promotion of the tensor cores' sums
            lt_fast = graph_ms(lambda: torch._scaled_mm(a.q, w_q.t(), scale_a=a.scale, scale_b=w_s.view(1, -1),
                                                        out_dtype=torch.bfloat16, use_fast_accum=True))
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
            bf = graph_ms(lambda: torch.nn.functional.linear(x, w))
            del w
            ok = []
            for cfg in MEDIUM_SWEEP:
                if cfg["block_m"] > 2 * m or (m >= 256 and cfg["block_m"] < 64):
                    continue
                try:
                    ok.append({**cfg, "ms": graph_ms(lambda: fp8_linear_small_m(a, w_q, w_s, None, torch.bfloat16, cfg),
                                                     reps=20)})
                except Exception:  # a shape Triton cannot build
                    continue
            top = min(ok, key=lambda s: s["ms"])
            out[f"{name} M={m}"] = {"scaled_mm_ms": lt, "scaled_mm_fast_accum_ms": lt_fast, "bf16_ms": bf,
                                    "best": top, "top": sorted(ok, key=lambda s: s["ms"])[:5]}
            print(f"medium {name:8s} M={m:3d} bf16 {bf*1e3:7.1f} us  cuBLASLt {lt*1e3:7.1f} fast-accum {lt_fast*1e3:7.1f} "
                  f"triton best {top['ms']*1e3:7.1f} "
                  f"{dict((k2, top[k2]) for k2 in ('block_m', 'block_n', 'block_k', 'num_stages'))}", flush=True)
    res["medium_rows"] = out
    # Prefill-sized rows: cuBLASLt with and without fast accumulation, and each one's error
    # against the float32 product of the same quantized numbers.
    big: dict = {}
    for name, (n, k) in SHAPES.items():
        w_q, w_s = fp8.quantize_weight(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02)
        for m in (1024, 4096):
            a = fp8.quantize_rows(torch.randn(m, k, device=dev, dtype=torch.bfloat16))
            ref = (a.q.float() * a.scale) @ (w_q.float() * w_s[:, None]).t()
            row = {}
            for fast in (False, True):
                f = lambda: torch._scaled_mm(a.q, w_q.t(), scale_a=a.scale, scale_b=w_s.view(1, -1),
                                             out_dtype=torch.bfloat16, use_fast_accum=fast)
                err = ((f().float() - ref).norm() / ref.norm()).item()
                row["fast" if fast else "plain"] = {"ms": graph_ms(f), "rel_err": err}
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
            row["bf16_ms"] = graph_ms(lambda: torch.nn.functional.linear(x, w))
            del w, ref
            big[f"{name} M={m}"] = row
            print(f"large  {name:8s} M={m:4d} bf16 {row['bf16_ms']*1e3:7.1f} us  cuBLASLt {row['plain']['ms']*1e3:7.1f} "
                  f"(err {row['plain']['rel_err']:.2e}) fast-accum {row['fast']['ms']*1e3:7.1f} (err {row['fast']['rel_err']:.2e})",
                  flush=True)
    res["large_rows"] = big


# One row (--one-row): the tensor-core kernel's launch shapes again, 16-channel tiles included
# (twice the programs for the small projections, which reach half the bandwidth of the big ones).
ONE_ROW_SWEEP = [dict(block_n=bn, block_k=bk, split_k=1, num_warps=w, num_stages=st)
                 for bn, bk, w, st in itertools.product((16, 32), (128, 256, 512), (2, 4), (3, 4, 5, 6))]


def one_row(res: dict) -> None:
    """The few-rows kernel over ONE_ROW_SWEEP at one row per projection; then one decode step's
    linears (32 layers, each its own weights, so nothing is served from L2; bf16 LM head) with
    the engine's shapes and with the sweep's best per projection."""
    dev = "cuda"
    out: dict = {}
    best: dict = {}
    for name, (n, k) in SHAPES.items():
        # enough copies of the weight that a pass over them does not fit the 60 MB L2 (a single
        # small weight replayed would be read from L2, not memory)
        copies = max(1, -(-240_000_000 // (n * k)))
        wts = [fp8.quantize_weight(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02) for _ in range(copies)]
        gb = n * k / 1e9
        a = fp8.quantize_rows(torch.randn(1, k, device=dev, dtype=torch.bfloat16))

        def each(cfg):
            for w_q, w_s in wts:
                fp8_linear_small_m(a, w_q, w_s, None, torch.bfloat16, cfg)

        engine = graph_ms(lambda: each(None)) / copies
        ok = []
        for cfg in ONE_ROW_SWEEP:
            try:
                ok.append({**cfg, "ms": graph_ms(lambda: each(cfg), reps=20) / copies})
            except Exception as e:  # a shape Triton cannot build
                print(f"one-row {name} {cfg}: {type(e).__name__}", flush=True)
        top = min(ok, key=lambda s: s["ms"])
        best[name] = top
        out[name] = {"engine_ms": engine, "engine": small_m_config(n, k), "best": top,
                     "top": sorted(ok, key=lambda s: s["ms"])[:5]}
        print(f"one-row {name:8s} engine {engine*1e3:6.1f} us ({gb/engine*1e3:5.0f} GB/s)  best {top['ms']*1e3:6.1f} "
              f"({gb/top['ms']*1e3:5.0f} GB/s) {dict((k2, top[k2]) for k2 in ('block_n', 'block_k', 'num_warps', 'num_stages'))}",
              flush=True)
    res["one_row"] = out
    layers = 32
    ws = {nm: [fp8.quantize_weight(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02) for _ in range(layers)]
          for nm, (n, k) in SHAPES.items()}
    head = torch.randn(128256, 4096, device=dev, dtype=torch.bfloat16) * 0.02
    acts = {nm: fp8.quantize_rows(torch.randn(1, k, device=dev, dtype=torch.bfloat16)) for nm, (n, k) in SHAPES.items()}
    hx = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)

    def run(cfgs):
        for i in range(layers):
            for nm in SHAPES:
                fp8_linear_small_m(acts[nm], *ws[nm][i], None, torch.bfloat16, cfgs and cfgs[nm])
        torch.nn.functional.linear(hx, head)

    step = {"engine_ms": graph_ms(lambda: run(None), 20), "best_ms": graph_ms(lambda: run(best), 20)}
    print(f"step M=1: engine {step['engine_ms']:.3f} ms  best per projection {step['best_ms']:.3f} ms", flush=True)
    res["one_row_step_linears"] = step


def parts(res: dict) -> None:
    """What one FP8 decoder layer's kernels cost beside bf16's, at a few batch sizes (Llama-3.1-8B
    shapes), each replayed from a CUDA graph: the norms with and without quantized output, SiLU-mul
    with and without, the separate row quantization before o_proj, and each projection's GEMM (µs)."""
    dev, h, inter = "cuda", 4096, 14336
    res["rows"] = {}
    ws = {nm: torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for nm, (n, k) in SHAPES.items()}
    qs = {nm: fp8.quantize_weight(w) for nm, w in ws.items()}
    for m in (1, 64, 256, 512):
        x = torch.randn(m, h, device=dev, dtype=torch.bfloat16)
        r = torch.randn(m, h, device=dev, dtype=torch.bfloat16)
        w = torch.rand(h, device=dev, dtype=torch.bfloat16) + 0.5
        gu = torch.randn(m, 2 * inter, device=dev, dtype=torch.bfloat16)
        row = {
            "add_norm_bf16": graph_ms(lambda: norm.fused_add_rms_norm(x, r, w, 1e-5)),
            "add_norm_fp8": graph_ms(lambda: norm.fused_add_rms_norm(x, r, w, 1e-5, quant=True)),
            "silu_bf16": graph_ms(lambda: activation.silu_and_mul(gu)),
            "silu_fp8": graph_ms(lambda: activation.silu_and_mul(gu, quant=True)),
            "quantize_rows_4096": graph_ms(lambda: fp8.quantize_rows(x)),
        }
        for nm, (n, k) in SHAPES.items():
            xa = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            a = fp8.quantize_rows(xa)
            row[f"{nm}_bf16"] = graph_ms(lambda: torch.nn.functional.linear(xa, ws[nm]))
            row[f"{nm}_fp8"] = graph_ms(lambda: fp8.fp8_linear(a, *qs[nm]))
        row = {k: v * 1e3 for k, v in row.items()}  # microseconds
        layer_bf16 = 2 * row["add_norm_bf16"] + row["silu_bf16"] + sum(row[f"{nm}_bf16"] for nm in SHAPES)
        layer_fp8 = (2 * row["add_norm_fp8"] + row["silu_fp8"] + row["quantize_rows_4096"]
                     + sum(row[f"{nm}_fp8"] for nm in SHAPES))
        row.update(layer_bf16_us=layer_bf16, layer_fp8_us=layer_fp8)
        res["rows"][m] = row
        print(f"M={m:3d} " + "  ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)


def graph_ms(fn, reps: int = 50) -> float:
    """Median ms of ``fn`` replayed from a CUDA graph (launch cost excluded, as the engine runs)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return do_bench(g.replay, warmup=10, rep=reps)


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = Path(args[0] if args else os.path.join(os.environ.get("OUT", "."), "fp8_bench.json"))
    modes = {"--medium": medium, "--one-row": one_row, "--parts": parts}
    mode = next((fn for flag, fn in modes.items() if flag in sys.argv), None)
    if mode is not None:
        res = {"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("INFIRE_COMMIT", ""),
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        mode(res)
        out.write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {out}")
        return 0
    dev = "cuda"
    torch.manual_seed(0)
    res: dict = {"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("INFIRE_COMMIT", ""),
                 "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "shapes": {}}
    best: dict[str, dict] = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        w_q, w_s = fp8.quantize_weight(w)
        gb = n * k / 1e9
        row: dict = {}
        for m in ROWS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            a = fp8.quantize_rows(x)
            r = {"bf16_ms": graph_ms(lambda: torch.nn.functional.linear(x, w)),
                 "scaled_mm_ms": graph_ms(lambda: torch._scaled_mm(a.q, w_q.t(), scale_a=a.scale,
                                                                   scale_b=w_s.view(1, -1), out_dtype=torch.bfloat16)),
                 "default_ms": graph_ms(lambda: fp8_linear_small_m(a, w_q, w_s, None, torch.bfloat16))}
            sweep = []
            for cfg in SWEEP:
                try:
                    ms = graph_ms(lambda: fp8_linear_small_m(a, w_q, w_s, None, torch.bfloat16, cfg), reps=20)
                except Exception as e:  # a shape Triton cannot build (registers, shared memory)
                    sweep.append({**cfg, "error": f"{type(e).__name__}"[:60]})
                    continue
                sweep.append({**cfg, "ms": ms, "gb_s": gb / (ms / 1e3)})
            ok = [s for s in sweep if "ms" in s]
            top = min(ok, key=lambda s: s["ms"])
            r.update(best=top, default=small_m_config(n, k), default_gb_s=gb / (r["default_ms"] / 1e3),
                     bf16_gb_s=2 * gb / (r["bf16_ms"] / 1e3), sweep=sorted(ok, key=lambda s: s["ms"])[:8],
                     errors=len(sweep) - len(ok))
            row[m] = r
            if m == 1:
                best[name] = top
            print(f"{name:8s} M={m:2d} bf16 {r['bf16_ms']*1e3:7.1f} us  scaled_mm {r['scaled_mm_ms']*1e3:7.1f}  "
                  f"default {r['default_ms']*1e3:7.1f} ({r['default_gb_s']:6.0f} GB/s)  best {top['ms']*1e3:7.1f} "
                  f"({top['gb_s']:6.0f} GB/s) {dict((k2, top[k2]) for k2 in ('block_n', 'block_k', 'split_k', 'num_stages'))}",
                  flush=True)
        res["shapes"][name] = {"n": n, "k": k, "rows": row}
    # One decode step's linears (32 layers) at one row: bf16, the engine's FP8 (default launch
    # shapes), the best of the sweep per shape.
    layers = 32
    ws = {nm: torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for nm, (n, k) in SHAPES.items()}
    qs = {nm: fp8.quantize_weight(w) for nm, w in ws.items()}
    head = torch.randn(128256, 4096, device=dev, dtype=torch.bfloat16) * 0.02
    step: dict = {}
    for m in ROWS:
        xs = {nm: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for nm, (n, k) in SHAPES.items()}
        acts = {nm: fp8.quantize_rows(x) for nm, x in xs.items()}
        hx = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)

        def bf16():
            for _ in range(layers):
                for nm in SHAPES:
                    torch.nn.functional.linear(xs[nm], ws[nm])
            torch.nn.functional.linear(hx, head)

        def ours(cfgs=None):
            for _ in range(layers):
                for nm in SHAPES:
                    if cfgs is None:
                        fp8.fp8_linear(acts[nm], *qs[nm])
                    else:
                        fp8_linear_small_m(acts[nm], *qs[nm], None, torch.bfloat16, cfgs[nm])
            torch.nn.functional.linear(hx, head)

        step[m] = {"bf16_ms": graph_ms(bf16, 20), "fp8_ms": graph_ms(ours, 20),
                   "fp8_best_ms": graph_ms(lambda: ours(best), 20)}
        print(f"step M={m:2d}: bf16 {step[m]['bf16_ms']:.3f} ms  fp8 {step[m]['fp8_ms']:.3f}  "
              f"fp8 (best per shape) {step[m]['fp8_best_ms']:.3f}", flush=True)
    res["decode_step_linears"] = step
    res["best_at_one_row"] = best
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

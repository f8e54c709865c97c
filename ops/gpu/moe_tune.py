"""Tune the experts' grouped GEMM on this GPU and keep the result where the engine reads it
(engine/kernels/moe_configs/, engine/kernels/moe_configs.py).

Usage: ``python3 ops/gpu/moe_tune.py [--shape qwen3-30b-a3b|mixtral-8x7b] [--tokens 1,8,...]
[--budget-s S]``. For each of the layer's two GEMMs (gate-up: N = 2I, K = H, timed gated as the
engine runs it, SiLU(gate) · up stored; down: N = H, K = I), bf16 and FP8 weights, and each
token count, the candidates of the count's tile height (:func:`candidates`) are timed on the
step's own routing (random router logits, top-k as the model routes) with
``triton.testing.do_bench``; a candidate whose output differs from the default's beyond float
noise is dropped. The fastest per token count is written as one JSON table per GEMM shape, with
the default's time beside it (``speedup``), so a table that gains nothing says so; counts the
budget did not reach are left out (a step of such a count takes the nearest tuned one above).
Commit the files it writes, with the docs/perf.md row of the run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from engine.kernels.fp8 import quantize_weight  # noqa: E402
from engine.kernels.moe import BLOCK_M, Router, align, route, tile_rows  # noqa: E402
from engine.kernels.moe_configs import TABLES, GemmShape, default_shape, table_name, weights_name  # noqa: E402
from engine.kernels.moe_triton import grouped_gemm_triton  # noqa: E402

SHAPES = {"qwen3-30b-a3b": dict(experts=128, top_k=8, hidden=2048, inter=768),
          "mixtral-8x7b": dict(experts=8, top_k=2, hidden=4096, inter=14336)}
# Candidates by the tile height a token count runs with (moe.tile_rows): 16-row tiles read a few
# experts' weights for a few rows each (memory-bound: narrow column tiles for more programs, long
# K steps), 64-row tiles are compute-bound (wide tiles, more warps). Each distinct shape is a
# compile (~1 s): the whole cross product (~90 a height) did not fit a device call.
SHORT = [GemmShape(n, k, w, s) for n, k, w, s in itertools.product((16, 32, 64, 128), (64, 128, 256), (4,), (3, 4))]
TALL = [GemmShape(n, k, w, s) for n, k, w, s in itertools.product((64, 128, 256), (32, 64), (4, 8), (3, 4))]


def candidates(block_m: int, gated: bool) -> list[GemmShape]:
    """The shapes timed for a tile height; a gated gate-up keeps two accumulators, so its column
    tiles stop at 128."""
    return [c for c in (TALL if block_m > BLOCK_M else SHORT) if not (gated and c.block_n > 128)]


def tune_one(experts: int, top_k: int, n_out: int, k_in: int, fp8: bool, tokens: list[int], per_pair: bool,
             gen: torch.Generator, deadline: float) -> dict:
    """The best shape per token count (those reached before ``deadline``, a ``time.monotonic``)."""
    w = torch.randn(experts, n_out, k_in, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    scale = None
    if fp8:
        q, s = quantize_weight(w.reshape(-1, k_in))
        w, scale = q.view(experts, n_out, k_in), s.view(experts, n_out)
    entries, report = {}, {}
    for n in tokens:
        if time.monotonic() > deadline:
            print(json.dumps({"n_out": n_out, "k_in": k_in, "fp8": fp8, "tokens": n, "skipped": "out of time"}))
            continue
        logits = torch.randn(n, experts, device="cuda", generator=gen)
        weights, chosen = route(logits, Router(top_k, renormalize=True))
        r = align(chosen, weights, experts, tile_rows(n * top_k, experts))
        a = torch.randn(n * top_k if per_pair else n, k_in, device="cuda", dtype=torch.bfloat16, generator=gen)

        def run(shape: GemmShape):
            return grouped_gemm_triton(a, w, r.pair_ids, r.tile_expert, r.weights, r.top_k, r.block_m, per_pair,
                                       "output" if per_pair else "none", scale, gated=not per_pair, shape=shape)

        base_shape = default_shape(n_out, k_in, gated=not per_pair)
        want = run(base_shape).float()
        base = float(do_bench(lambda: run(base_shape), warmup=10, rep=50, return_mode="median"))
        best, best_ms = base_shape, base
        for shape in candidates(r.block_m, not per_pair):
            try:
                got = run(shape).float()
            except Exception:  # noqa: BLE001 - a shape this GPU cannot launch (shared memory): not a candidate
                continue
            if not torch.allclose(got, want, atol=2e-2, rtol=2e-2):
                continue
            ms = float(do_bench(lambda: run(shape), warmup=10, rep=50, return_mode="median"))
            if ms < best_ms:
                best, best_ms = shape, ms
        entries[str(n)] = best.__dict__
        report[str(n)] = {"ms": round(best_ms, 4), "default_ms": round(base, 4), "speedup": round(base / best_ms, 3)}
        print(json.dumps({"n_out": n_out, "k_in": k_in, "fp8": fp8, "tokens": n, **report[str(n)],
                          "shape": best.__dict__}), flush=True)
    return {"entries": entries, "timings": report}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--tokens", default="1,8,32,64,128,256,512,1024,2048,8192")
    ap.add_argument("--out-dir", default=str(TABLES))
    ap.add_argument("--budget-s", type=float, default=1e9,
                    help="seconds for the whole run, shared evenly by its four GEMMs; counts not reached are left out")
    a = ap.parse_args()
    start = time.monotonic()
    s = SHAPES[a.shape]
    tokens = sorted({int(t) for t in a.tokens.split(",")})
    gpu = torch.cuda.get_device_name()
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gemms = [(fp8, n_out, k_in, per_pair) for fp8 in (False, True)
             for n_out, k_in, per_pair in ((2 * s["inter"], s["hidden"], False), (s["hidden"], s["inter"], True))]
    for i, (fp8, n_out, k_in, per_pair) in enumerate(gemms):
        dtype = weights_name(torch.float8_e4m3fn if fp8 else torch.bfloat16)
        left = a.budget_s - (time.monotonic() - start)
        table = tune_one(s["experts"], s["top_k"], n_out, k_in, fp8, tokens, per_pair, gen,
                         time.monotonic() + left / (len(gemms) - i))
        if table["entries"]:
            path = out / table_name(s["experts"], n_out, k_in, dtype, gpu)
            path.write_text(json.dumps({"gpu": gpu, "layer": a.shape, **table}, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""The experts' layer alone on the GPU: ``fused_experts`` (engine/kernels/moe.py: route, align,
two grouped GEMMs) at a full-size MoE layer's shape, bf16 and FP8 experts, by token count.

Usage: ``python ops/gpu/moe_bench.py [--shape qwen3-30b-a3b|mixtral-8x7b] [--out FILE] [--align]``.
``--align``: the alignment alone instead, the one-program kernel against the torch formulation
at each decode bucket's pair count (graph replays; the slots checked equal).
Issue 37's kernel figures: at decode sizes the bytes it must read — the weights of every expert
the step's tokens route to (random routing touches nearly all of them from 64 tokens on) — over
its time, against the GPU's HBM bandwidth; at prefill sizes its FLOPs (2 · tokens · top_k ·
3 · hidden · intermediate) over its time. Router logits are random (uniform routing: the
balanced case). ``ms``: the layer replayed from a CUDA graph, as the engine serves it (the figures
above are from it; ``fp8_bench.graph_ms``, the mean of ``triton.testing.do_bench``); ``eager_ms``:
the same launched op by op, a median (at decode sizes mostly the host's launches: ~0.5 ms for any
step on an H100).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from engine.kernels.fp8 import quantize_weight  # noqa: E402
from engine.kernels import _dispatch  # noqa: E402
from engine.kernels.moe import BLOCK_M, ExpertStack, Router, align, fused_experts, route  # noqa: E402
from ops.bench.engine_bench import _commit  # noqa: E402
from ops.gpu.fp8_bench import graph_ms  # noqa: E402

SHAPES = {"qwen3-30b-a3b": dict(experts=128, top_k=8, hidden=2048, inter=768),
          "mixtral-8x7b": dict(experts=8, top_k=2, hidden=4096, inter=14336)}
TOKENS = (1, 8, 32, 64, 128, 256, 512, 2048, 8192)


def stacks(e: int, h: int, inter: int, fp8: bool, gen: torch.Generator) -> tuple[ExpertStack, ExpertStack]:
    gu = torch.randn(e, 2 * inter, h, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    down = torch.randn(e, h, inter, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    if not fp8:
        return ExpertStack(gu), ExpertStack(down)
    out = []
    for w in (gu, down):
        q, s = quantize_weight(w.reshape(-1, w.shape[2]))
        out.append(ExpertStack(q.view(w.shape), s.view(w.shape[:2])))
    return out[0], out[1]


def align_rows(e: int, k: int, gen: torch.Generator) -> list[dict]:
    """The alignment alone by decode bucket: the one-program kernel and the torch formulation."""
    rows = []
    for n in (1, 8, 32, 64, 128, 256, 512):
        weights, experts = route(torch.randn(n, e, device="cuda", generator=gen), Router(k, renormalize=True))
        row = {"tokens": n, "pairs": n * k}
        for backend in ("triton", "torch"):
            _dispatch._forced = backend  # the kernels' backend, read at each call
            got = align(experts, weights, e, BLOCK_M)
            row[f"{backend}_ms"] = round(float(graph_ms(lambda: align(experts, weights, e, BLOCK_M), reps=100)), 4)
            row[f"{backend}_slots"] = got.pair_ids
        _dispatch._forced = None
        same = torch.equal(row.pop("triton_slots"), row.pop("torch_slots"))
        rows.append({**row, "same_slots": same})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "moe_bench.json"))
    ap.add_argument("--align", action="store_true", help="the alignment alone (see the module)")
    a = ap.parse_args()
    s = SHAPES[a.shape]
    e, k, h, inter = s["experts"], s["top_k"], s["hidden"], s["inter"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    if a.align:
        rows = align_rows(e, k, gen)
    for fp8 in () if a.align else (False, True):
        gu, down = stacks(e, h, inter, fp8, gen)
        wbytes = 1 if fp8 else 2
        for n in TOKENS:
            x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, generator=gen)
            logits = torch.randn(n, e, device="cuda", dtype=torch.bfloat16, generator=gen)
            touched = int(torch.topk(logits.float().softmax(-1), k, dim=-1).indices.unique().numel())
            layer = lambda: fused_experts(x, gu, down, logits, Router(k, renormalize=True))  # noqa: E731
            eager_ms = float(do_bench(layer, warmup=20, rep=100, return_mode="median"))
            ms = float(graph_ms(layer, reps=100))
            read = touched * 3 * h * inter * wbytes + 2 * n * h * 2  # the routed experts' weights, x in and out
            flops = 2 * n * k * 3 * h * inter
            row = {"weights": "fp8" if fp8 else "bf16", "tokens": n, "experts_touched": touched, "ms": round(ms, 4),
                   "eager_ms": round(eager_ms, 4),
                   "gb_s": round(read / ms / 1e6, 1), "tflop_s": round(flops / ms / 1e9, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "shape": a.shape, **s,
              "gpu": torch.cuda.get_device_name(), "commit": _commit(),
              "rows": rows}
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

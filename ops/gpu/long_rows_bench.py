"""Decode attention of batches that hold long rows: one layer, the engine's kernels, with and
without the cascade plan's long-row tiles (engine/runner/cascade.py, "Long rows").

Usage: ``python ops/gpu/long_rows_bench.py [--tree DIR] [--label NAME] [--out FILE]``.
Llama-3.1-8B's heads (32 query, 8 KV, head_dim 128), bfloat16, a 16-token paged cache with
shuffled pages; ``max_seq_len`` = 131,072 (what a CUDA graph of a Llama 3.1 runner captures
with). Batches: 64 short rows (600 positions) alone; the same with one and with eight rows of
32k beside them (a long prompt decoding among chat streams, issue 38's mixed phase); eight and
one rows of 32k alone (few-row steps: splits from the SM count). Each is timed without a plan
and, where the tree has long-row tiles, with the plan a step would stage. ``--tree`` imports
``engine`` from another checkout (an A/B in one device run). GB/s counts each row's K and V once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("--tree", default=str(Path(__file__).resolve().parents[2]))
ap.add_argument("--label", default="this tree")
ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "long_rows_bench.json"))
args = ap.parse_args()
sys.path.insert(0, str(Path(args.tree).resolve()))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from engine.kernels.attention_triton import paged_attention_triton  # noqa: E402
from engine.runner import cascade as cascade_plans  # noqa: E402
from ops.bench.engine_bench import _commit  # noqa: E402 - the tree's (INFIRE_COMMIT on the GPU machine)
from paged_batch import BLOCK, D, HKV, HQ, paged_batch  # noqa: E402 - a sibling (run as a script)

BOUND = 131072
DEV = "cuda"
SHORT, LONG = 600, 32768
CASES = {"64 short": [SHORT] * 64, "64 short + 1 long": [SHORT] * 64 + [LONG],
         "64 short + 8 long": [SHORT] * 64 + [LONG] * 8, "8 long": [LONG] * 8, "1 long": [LONG]}


def plan_of(tables, sl):
    """The plan a step would stage, or None (a tree without long-row tiles, or nothing planned)."""
    if not hasattr(cascade_plans, "LONG_ROW_TOKENS"):
        return None
    b = sl.shape[0]
    per_tile = cascade_plans.rows_per_tile(HQ, HKV)
    if b < cascade_plans.MIN_ROWS:
        return None
    plan = cascade_plans.plan_cascade(tables.cpu().numpy(), sl.cpu().numpy(), np.ones(b, dtype=np.int64), BLOCK,
                                      per_tile, cascade_plans.max_tiles(b, per_tile))
    if not plan.rows:
        return None
    return torch.from_numpy(plan.tiles).to(DEV), torch.from_numpy(plan.kv_lo).to(DEV)


def main() -> None:
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows = []
    for name, lens in CASES.items():
        q, kc, vc, qsl, sl, tables = paged_batch([1] * len(lens), lens, gen)
        gb = sum(lens) * HKV * D * 2 * 2 / 1e9
        plain = paged_attention_triton(q, kc, vc, qsl, sl, tables, D ** -0.5, 1, BOUND)
        row = {"case": name, "rows": len(lens), "gb": round(gb, 3)}
        ms = float(do_bench(lambda: paged_attention_triton(q, kc, vc, qsl, sl, tables, D ** -0.5, 1, BOUND),
                            warmup=25, rep=200, return_mode="median"))
        row.update(plain_ms=round(ms, 4), plain_gbps=round(gb / ms * 1e3, 1))
        cascade = plan_of(tables, sl)
        if cascade is not None:
            out = paged_attention_triton(q, kc, vc, qsl, sl, tables, D ** -0.5, 1, BOUND, cascade=cascade)
            row["planned_max_abs_diff"] = float((out.float() - plain.float()).abs().max())
            ms = float(do_bench(lambda: paged_attention_triton(q, kc, vc, qsl, sl, tables, D ** -0.5, 1, BOUND,
                                                               cascade=cascade),
                                warmup=25, rep=200, return_mode="median"))
            row.update(planned_ms=round(ms, 4), planned_gbps=round(gb / ms * 1e3, 1))
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = {"label": args.label, "tree": args.tree, "gpu": torch.cuda.get_device_name(),
              "commit": _commit(), "max_seq_len": BOUND, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

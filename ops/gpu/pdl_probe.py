"""Programmatic dependent launch (PDL) off vs on, in one process: the offline sharegpt-like
workload and batch-1 decode, bf16 and FP8, each with the engine's kernels launched plainly and
then with PDL (engine.kernels._launch), and the greedy tokens of both compared (the kernels are
the same code, so they must agree exactly; a missing wait would show here first).

    . ops/gpu/env.sh; python3 ops/gpu/pdl_probe.py /tmp/m8b $OUT/pdl.json [num_requests] [quants]

quants: a comma list of none / fp8 (default both); for each, plain launches first, then PDL.
"""

from __future__ import annotations

import json
import sys

from engine.kernels import _launch
from ops.bench.engine_bench import _commit, _release_device, compare_outputs, run_bench


def main() -> int:
    model, out = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 1000
    quants = sys.argv[4].split(",") if len(sys.argv) > 4 else ["none", "fp8"]
    res: dict = {"commit": _commit(), "num_requests": n, "runs": []}
    for q in quants:
        outputs: dict[bool, dict] = {}
        for pdl in (False, True):
            _launch.PDL_ON = pdl
            toks: dict = {}
            r = run_bench(model, n, "cuda", 512, 16384, 2048, 16, batch1=True, outputs=toks,
                          quantization=None if q == "none" else q)
            _release_device("cuda")
            outputs[pdl] = toks
            row = {"quantization": q, "pdl": pdl, "total_tok_s": r["total_tok_s"], "batch1": r["batch1"],
                   "steps_by_kind": r["steps_by_kind"]}
            res["runs"].append(row)
            print(json.dumps(row), flush=True)
        res[f"{q}_pdl_vs_plain_outputs"] = compare_outputs(outputs[False], outputs[True])
        print(q, "outputs pdl vs plain", res[f"{q}_pdl_vs_plain_outputs"], flush=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Reload from the warm tier, bf16 beside FP8 (issue 19: "reload from the warm tier ≤ 0.35 s to
ready"): one engine with a warm tier; each model is loaded from its files, serves one request,
is unloaded (its weights go to the tier), and is loaded again three times from the tier, each
time timed to ``load_model``'s return (the model serves from then) and to its first token.

    . ops/gpu/env.sh; python3 ops/gpu/fp8_reload.py /tmp/m8b $OUT/fp8_reload.json
"""

from __future__ import annotations

import json
import sys
import time

from engine.core.engine_core import EngineCore
from engine.options import EngineOptions
from engine.sampling import SamplingParams
from engine.load_spec import LoadSpec
from ops.bench.engine_bench import _commit

GiB = 1 << 30


def _first_token(core, name: str) -> float:
    t = time.perf_counter()
    core.add_request(f"r{time.monotonic_ns()}", name, list(range(100, 228)),
                     SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    first = None
    while core.has_unfinished_requests():
        for o in core.step():
            if first is None and o.new_token_ids:
                first = time.perf_counter() - t
    return first


def main() -> int:
    model, out = sys.argv[1], sys.argv[2]
    core = EngineCore(EngineOptions(max_num_batched_tokens=8192, block_size=16, seed=0, warm_tier_bytes=20 * GiB),
                      device="cuda")
    t = time.perf_counter()
    core.loader.warm_tier.prepin()
    res: dict = {"commit": _commit(), "warm_tier_gib": 20, "prepin_s": time.perf_counter() - t, "runs": {}}
    for q in (None, "fp8"):
        name = q or "bf16"
        rows = []
        t = time.perf_counter()
        info = core.load_model(LoadSpec(name, model, max_model_len=2048, max_num_seqs=64, quantization=q))
        files_s = time.perf_counter() - t
        _first_token(core, name)
        for _ in range(3):
            core.unload_model(name)
            while core.has_unfinished_requests():
                core.step()
            held = any(k.split("|", 1)[0] == name for k in core.loader.warm_tier.models())  # keys: "name|..."
            t = time.perf_counter()
            core.load_model(LoadSpec(name, model, max_model_len=2048, max_num_seqs=64, quantization=q))
            ready = time.perf_counter() - t
            rows.append({"from_warm_tier": held, "ready_s": ready, "first_token_s": _first_token(core, name)})
        res["runs"][name] = {"weight_bytes": info.device_bytes, "load_from_files_s": files_s, "reloads": rows}
        print(name, json.dumps(res["runs"][name]), flush=True)
        core.unload_model(name)
    with open(out, "w") as f:
        json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

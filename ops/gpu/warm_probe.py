"""Where an engine's device memory goes across loads and unloads with a warm tier (issue 35: the
density run at b55f48c held ~16.7 GB beyond the ledger from the first eviction into the tier on).

    . ops/gpu/env.sh; python3 -m ops.gpu.warm_probe --model-dir /tmp/m8b --out $OUT/warm_probe.json

One EngineCore in this process (budget 0.9 of the device, a warm tier of --tier-gib pinned at
start), models a, b, c of the same files under three names; after every step a sample: the
driver's use (mem_get_info), nvidia-smi's figure for this process, the caching allocator's
reserved / allocated bytes, its segments grouped by (stream, pool) with their live bytes, and the
ledger's use. The step sequence is a swap chain: load a, b; unload a; load c; unload b; load a;
unload c ... The tier is keyed by the device bytes, not the name, so the three names share one
copy: the first unload puts it, later unloads keep it (``WarmTier.keep``), and every load after
the first unload restores from it (c's first load included); each sample's ``tier_models`` says
what the tier holds. With ``--traffic`` the loaded models serve while a load's weights stream in
the load thread (begin_load / finish_load), as in the daemon.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from collections import defaultdict

import torch

GIB = 1 << 30


def nvidia_smi_bytes() -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        pid, mib = (x.strip() for x in line.split(","))
        if pid == str(os.getpid()):
            return int(mib) << 20
    return sum(int(x.split(",")[1]) for x in out.splitlines() if "," in x) << 20 if out.strip() else None


def segments() -> dict[str, list[float]]:
    by: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for s in torch.cuda.memory_snapshot():
        key = f"stream={s.get('stream')} pool={s.get('segment_pool_id')}"
        by[key][0] += s["total_size"] / GIB
        by[key][1] += s["allocated_size"] / GIB
        by[key][2] += 1
    return {k: [round(v[0], 3), round(v[1], 3), v[2]] for k, v in by.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tier-gib", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=400)
    ap.add_argument("--traffic", action="store_true", help="the loaded models serve while a load runs")
    a = ap.parse_args()

    from engine.core.engine_core import EngineCore
    from engine.load_spec import LoadSpec
    from engine.options import EngineOptions
    from engine.sampling import SamplingParams
    from ops.bench.engine_bench import _commit

    free, total = torch.cuda.mem_get_info()
    budget = int(total * 0.9)
    core = EngineCore(EngineOptions(dtype="bfloat16", seed=0, warm_tier_bytes=a.tier_gib * GIB),
                      device="cuda", budget=budget)
    samples = []
    base_used = total - torch.cuda.mem_get_info()[0]

    def sample(label: str, **extra) -> None:
        torch.cuda.synchronize()
        f, t = torch.cuda.mem_get_info()
        m = core.memory()
        row = {"step": label, "t": round(time.perf_counter() - t0, 2),
               "driver_gib": round((t - f) / GIB, 3), "smi_gib": (round(x / GIB, 3) if (x := nvidia_smi_bytes()) else None),
               "reserved_gib": round(torch.cuda.memory_reserved() / GIB, 3),
               "allocated_gib": round(torch.cuda.memory_allocated() / GIB, 3),
               "ledger_used_gib": round(m.used / GIB, 3), "kv_gib": round(m.kv / GIB, 3),
               "weights_gib": round(m.weights / GIB, 3), "workspace_gib": round(m.workspace / GIB, 3),
               "tier_models": core.loader.warm_tier.models(), "segments": segments(), **extra}
        samples.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "segments"}), flush=True)

    t0 = time.perf_counter()
    sample("start", base_used_gib=round(base_used / GIB, 3))
    tp = time.perf_counter()
    core.loader.warm_tier.prepin()
    sample("prepinned", seconds=round(time.perf_counter() - tp, 2))
    spec = {n: LoadSpec(n, a.model_dir, max_model_len=a.max_model_len, max_num_seqs=64) for n in "abc"}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    rid = 0

    def serve(name: str) -> None:
        nonlocal rid
        rid += 1
        core.add_request(f"r{rid}", name, list(range(10, 60)), params)
        while core.has_unfinished_requests():
            core.step()

    def beside(name: str) -> None:
        """Load ``name`` in the load thread while the other loaded models serve, as the daemon does."""
        others = [n for n in core.models()]
        pending = core.begin_load(spec[name])
        nonlocal rid
        while not pending.done() or core.has_unfinished_requests():
            if not pending.done():
                for n in others:
                    rid += 1
                    core.add_request(f"r{rid}", n, list(range(10, 60)), params)
            core.step()
        core.finish_load(pending)
        serve(name)

    def step(kind: str, name: str) -> None:
        ts = time.perf_counter()
        if kind == "load" and a.traffic and core.models():
            beside(name)
        elif kind == "load":
            core.load_model(spec[name])
            serve(name)
        else:
            core.unload_model(name)
        sample(f"{kind} {name}", seconds=round(time.perf_counter() - ts, 3),
               timings=core.loader.last_load_timings if kind == "load" else None)

    try:
        for kind, name in [("load", "a"), ("load", "b"), ("unload", "a"), ("load", "c"), ("unload", "b"),
                           ("load", "a"), ("unload", "c"), ("load", "b"), ("unload", "a"), ("unload", "b")]:
            step(kind, name)
        torch.cuda.empty_cache()
        sample("empty_cache")
    finally:
        with open(a.out, "w") as f:
            json.dump({"budget_gib": round(budget / GIB, 3), "total_gib": round(total / GIB, 3),
                       "commit": _commit(), "samples": samples}, f, indent=1)


if __name__ == "__main__":
    main()

"""Where a reload's KV-pool fit spends its time (the warm-tier load's ``pool_s``).

Usage: ``python ops/gpu/pool_fit_probe.py MODEL_DIR [out.json]``

Part 1, torch alone: a large device allocation (``torch.zeros``) timed fresh, then while a
16 GB host buffer is page-locked with ``cudaHostRegister`` (what the warm tier holds), then after
it is unregistered. Part 2, the engine: load from the page cache, unload into the warm tier, load
again, with the pool fit's pieces (``gc.collect``, ``empty_cache``, the pool's allocation) timed
by wrapping them, each behind a device sync.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from engine.kv import page_memory
from engine.core.engine_core import EngineCore
from engine.options import EngineOptions
from engine.runner.cuda_graphs import DEFAULT_BUCKETS
from engine.weights.loader import weight_files
from engine.load_spec import LoadSpec

TIMES: dict[str, list[float]] = defaultdict(list)


def timed(owner, name: str, label: str):
    fn = getattr(owner, name)

    def wrapper(*a, **k):
        torch.cuda.synchronize()
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            torch.cuda.synchronize()
            TIMES[label].append(time.perf_counter() - t)
    setattr(owner, name, wrapper)


def alloc_s(nbytes: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    x = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    s = time.perf_counter() - t
    del x
    torch.cuda.empty_cache()
    return s


def torch_alone() -> dict:
    big = 90 << 30
    res = {"fresh_s": [alloc_s(big) for _ in range(2)]}
    host = torch.empty(16 << 30, dtype=torch.uint8)
    host.fill_(1)  # fault the pages in first, as the tier's copy does
    cudart = torch.cuda.cudart()
    t = time.perf_counter()
    err = cudart.cudaHostRegister(host.data_ptr(), host.numel(), 0)
    res["register_s"] = time.perf_counter() - t
    res["register_err"] = int(err)
    res["with_16gb_registered_s"] = [alloc_s(big) for _ in range(2)]
    cudart.cudaHostUnregister(host.data_ptr())
    res["after_unregister_s"] = [alloc_s(big) for _ in range(2)]
    return res


def engine_case(model_dir: str) -> dict:
    files = weight_files(model_dir)
    size = sum(f.stat().st_size for f in files)
    core = EngineCore(EngineOptions(decode_buckets=DEFAULT_BUCKETS, warmup=True, warm_tier_bytes=size + (1 << 30)),
                      device="cuda")
    out = {}
    core.load_model(LoadSpec("m", model_dir, max_model_len=4096, max_num_seqs=256))
    core.unload_model("m")  # into the tier
    timed(gc, "collect", "gc.collect")
    timed(torch.cuda, "empty_cache", "empty_cache")
    timed(page_memory.PoolMemory, "_zeros", "pool _zeros")
    timed(page_memory.PoolMemory, "resize", "pool resize")
    timed(type(core), "_fit_pool", "_fit_pool")
    for case in ("warm_tier_1", "warm_tier_2"):
        TIMES.clear()
        core.load_model(LoadSpec("m", model_dir, max_model_len=4096, max_num_seqs=256))
        out[case] = {"timings": dict(core.loader.last_load_timings), "pieces": {k: v for k, v in TIMES.items()},
                     "pool_pages": core.pools.pool.num_pages, "page_bytes": core.pools.pool.page_bytes}
        TIMES.clear()
        core.unload_model("m")
        out[case + "_unload_pieces"] = {k: v for k, v in TIMES.items()}
    return out


def main() -> int:
    model_dir = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.environ.get("OUT", "."), "pool_fit.json")
    res = {"torch_alone": torch_alone(), "engine": engine_case(model_dir)}
    Path(out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res)[:6000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

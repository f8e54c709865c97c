"""Engine load → ready on the GPU: page cache warm, warm tier, page cache dropped; dd's disk rate;
another model's decoding while a load runs beside it.

Usage: ``python ops/gpu/engine_load_bench.py MODEL_DIR [out.json] [--device cuda] [--skip-dropped]
[--no-overlap]`` (default ``$OUT/engine_load.json``; ``LOAD_SKIP_DROPPED=1`` = ``--skip-dropped``).

Each case is ``EngineCore.load_model`` (book, weights in a load thread, KV pages, runner + decode
CUDA graphs, warm-up) and then one 16-token request to its first token; each reports the core's
``last_load_timings`` (config_s, book_s, alloc_s, weights_s, rope_s, wait_s, install_s, runner_s,
warmup_s, measure_s, total_s; warm / warmup_skipped as 0/1). Cases, on the core's own warm tier:
page cache warm (the tier's copy discarded first); warm tier (the copy stashed by the previous
unload, the workspace figure measured then reused: no warm-up); warm tier at a new shape
(max_num_seqs 128: the warm-up runs again, to show its cost); page cache dropped
(``/proc/sys/vm/drop_caches`` when writable, else ``posix_fadvise(DONTNEED)``). The disk's own
rate is ``dd`` of the largest weight file, cache dropped, in the same run. ``overlap``: model "a"
decodes 32 sequences while "b" (the same files) loads from the page cache through
``begin_load``/``finish_load``: a's step times before and during the load, and its tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from engine.core.engine_core import EngineCore  # noqa: E402
from engine.options import EngineOptions  # noqa: E402
from engine.runner.cuda_graphs import DEFAULT_BUCKETS  # noqa: E402
from engine.weights.loader import weight_files  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.load_spec import LoadSpec  # noqa: E402

PHASES = ("config_s", "book_s", "alloc_s", "weights_s", "rope_s", "wait_s", "install_s", "runner_s",
          "warmup_s", "measure_s", "total_s")


def sync(core: EngineCore) -> None:
    if core.device.type == "cuda":
        torch.cuda.synchronize(core.device)


def drop_caches(files: list[Path]) -> str:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise"


def warm(files: list[Path]) -> None:
    buf = bytearray(64 << 20)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf) > 0:
                pass


def dd_rate(path: Path, files: list[Path]) -> dict:
    drop_caches(files)
    p = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=64M"], capture_output=True, text=True, timeout=300)
    m = re.search(r"(\d+) bytes.*copied, ([\d.]+) s", p.stderr)
    if not m:
        return {"error": p.stderr[-300:]}
    n, s = int(m.group(1)), float(m.group(2))
    return {"file": path.name, "bytes": n, "seconds": s, "gb_s": n / s / 1e9}


def load_once(core: EngineCore, model_dir: str, max_num_seqs: int = 256) -> dict:
    sync(core)
    pool = core.pools.pool
    pages0, resizes0 = (pool.num_pages if pool is not None else 0), core.pools.resizes
    t0 = time.perf_counter()
    info = core.load_model(LoadSpec("m", model_dir, max_model_len=4096, max_num_seqs=max_num_seqs))
    sync(core)
    t1 = time.perf_counter()
    core.add_request("q", "m", list(range(100, 116)), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while core.has_unfinished_requests():
        core.step()
    t2 = time.perf_counter()
    g = core.slots.get("m").runner.graphs
    return {"load_s": t1 - t0, "to_first_token_s": t2 - t0, "device_gb": info.device_bytes / 1e9,
            "graph_capture_s": g.capture_seconds if g else None, "graph_warmup_s": g.warmup_seconds if g else None,
            "timings": dict(core.loader.last_load_timings),
            # the KV pool before and after (a re-creation rebuilds the runner) and the workspace
            # booked: a reload that books the workspace measured at the first load resizes once
            "pool_pages": [pages0, core.pools.pool.num_pages], "pool_resizes": core.pools.resizes - resizes0,
            "workspace_bytes": core.slots.get("m").workspace.held, "step_bytes": core.slots.get("m").workspace.step}


def unload(core: EngineCore, res: dict, key: str) -> None:
    t = time.perf_counter()
    core.unload_model("m")
    res[key] = time.perf_counter() - t


def overlap(core: EngineCore, model_dir: str, files: list[Path]) -> dict:
    """Model "a" decodes while "b" loads beside it (what the worker's loop does)."""
    core.load_model(LoadSpec("a", model_dir, max_model_len=4096, max_num_seqs=32))
    params = SamplingParams(temperature=0, max_tokens=100000, ignore_eos=True)
    for i in range(32):
        core.add_request(f"a{i}", "a", list(range(100 + i, 164 + i)), params)

    def steps(n: int) -> list[float]:
        out = []
        for _ in range(n):
            t = time.perf_counter()
            core.step()
            out.append(time.perf_counter() - t)
        return out

    steps(20)  # prefill and the first decodes
    alone = steps(50)
    warm(files)
    t0 = time.perf_counter()
    pending = core.begin_load(LoadSpec("b", model_dir, max_model_len=4096, max_num_seqs=32))
    begin_s = time.perf_counter() - t0
    during: list[float] = []
    while not pending.done():
        during += steps(1)
    t1 = time.perf_counter()
    core.finish_load(pending)
    finish_s = time.perf_counter() - t1
    total = time.perf_counter() - t0
    for i in range(32):
        core.abort_request(f"a{i}")
    core.step()
    core.unload_model("a")
    core.unload_model("b")
    med = statistics.median
    return {"begin_s": begin_s, "finish_s": finish_s, "load_s": total, "steps_during": len(during),
            "step_ms_alone_p50": med(alone) * 1e3, "step_ms_during_p50": med(during) * 1e3 if during else None,
            "step_ms_during_max": max(during) * 1e3 if during else None,
            "a_tokens_during": 32 * len(during), "timings": dict(core.loader.last_load_timings)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("out", nargs="?", default=str(Path(os.environ.get("OUT", ".")) / "engine_load.json"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--skip-dropped", action="store_true", default=os.environ.get("LOAD_SKIP_DROPPED") == "1")
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="the step budget, which sizes the warm-up step (default: the engine's, the daemon's 4096)")
    a = ap.parse_args()
    files = weight_files(a.model_dir)
    size = sum(f.stat().st_size for f in files)
    cuda = a.device == "cuda"
    budget = {} if a.max_num_batched_tokens is None else {"max_num_batched_tokens": a.max_num_batched_tokens}
    core = EngineCore(EngineOptions(decode_buckets=DEFAULT_BUCKETS if cuda else (), warmup=True,
                                    warm_tier_bytes=size + (1 << 30), **budget), device=a.device)
    core.loader.warm_tier.prepin()  # page-locked once, as the worker does at start (never on a put)
    res: dict = {"model_dir": str(a.model_dir), "file_bytes": size,
                 "gpu": torch.cuda.get_device_name() if cuda else a.device}
    if not a.skip_dropped:
        res["dd"] = dd_rate(max(files, key=lambda f: f.stat().st_size), files)
    warm(files)
    tier, core.loader.warm_tier = core.loader.warm_tier, None  # no stash (seconds of copying) where none is used
    res["first_load"] = load_once(core, a.model_dir)  # Triton compiles land in the cache
    key = core.slots.get("m").warm_key  # its copy's key in the tier (the files and their form)
    unload(core, res, "first_unload_s")
    core.loader.warm_tier = tier
    warm(files)
    res["page_cache_warm"] = load_once(core, a.model_dir)
    unload(core, res, "warm_tier_put_s")
    res["warm_tier_put_split"] = dict(tier.last_put_seconds)
    res["warm_tier"] = load_once(core, a.model_dir)
    unload(core, res, "warm_tier_keep_s")  # the stored copy is kept, not copied again
    res["warm_tier_new_shape"] = load_once(core, a.model_dir, max_num_seqs=128)
    core.loader.warm_tier = None
    unload(core, res, "unload_s")
    tier.discard(key)
    if not a.skip_dropped:
        res["drop_method"] = drop_caches(files)
        res["page_cache_dropped"] = load_once(core, a.model_dir)
        unload(core, res, "unload_dropped_s")
        gbs = size / res["page_cache_dropped"]["load_s"] / 1e9
        res["dropped_gb_s"] = gbs
        res["dropped_vs_dd"] = gbs / res["dd"]["gb_s"] if "gb_s" in res["dd"] else None
    if not a.no_overlap:
        res["overlap"] = overlap(core, a.model_dir, files)
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    cases = ("page_cache_warm", "warm_tier", "warm_tier_new_shape", "page_cache_dropped")
    print(f"{'case':<20} {'load s':>7} {'1st tok':>7} " + " ".join(f"{p[:-2]:>8}" for p in PHASES) + "  warm skip")
    for k in cases:
        r = res.get(k)
        if r:
            t = r["timings"]
            print(f"{k:<20} {r['load_s']:>7.3f} {r['to_first_token_s']:>7.3f} "
                  + " ".join(f"{t.get(p, 0):>8.3f}" for p in PHASES)
                  + f"  {t.get('warm', 0):.0f} {t.get('warmup_skipped', 0):.0f}")
    split = " ".join(f"{k} {v:.2f}" for k, v in res["warm_tier_put_split"].items())
    print(f"unload: put into the tier {res['warm_tier_put_s']:.2f} s ({split}), keep {res['warm_tier_keep_s']:.2f} s")
    if "dd" in res:
        print(f"dd {res['dd'].get('gb_s', 0):.2f} GB/s; dropped load at {res['dropped_gb_s']:.2f} GB/s "
              f"({(res.get('dropped_vs_dd') or 0) * 100:.0f}% of dd)")
    o = res.get("overlap")
    if o:
        print(f"overlap: b loaded in {o['load_s']:.2f} s (begin {o['begin_s']:.3f}, finish {o['finish_s']:.3f}) while "
              f"a took {o['steps_during']} steps; a's step p50 {o['step_ms_alone_p50']:.1f} ms alone, "
              f"{o['step_ms_during_p50'] or 0:.1f} ms during (max {o['step_ms_during_max'] or 0:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

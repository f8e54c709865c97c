"""Engine load → ready on the GPU: page cache warm, page cache dropped, warm tier; dd's disk rate.

Usage: ``python ops/gpu/engine_load_bench.py MODEL_DIR [out.json]`` (default ``$OUT/engine_load.json``).

Each case is ``EngineCore.load_model`` (weights streamed into the fused tensors, KV cache
allocated, decode CUDA graphs captured) and then one 16-token request to its first token.
Cases: page cache warm (the files read once before); dropped (``/proc/sys/vm/drop_caches`` when
writable, else ``posix_fadvise(DONTNEED)`` per file); warm tier (the weights put into a
:class:`engine.warm_tier.WarmTier` at the previous unload, restored by
:func:`engine.loader.load_or_restore` — the wiring core.py is to get). The disk's own rate is
``dd`` of the largest weight file, cache dropped, in the same run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import engine.core as core_mod  # noqa: E402
from engine.core import EngineCore  # noqa: E402
from engine.cuda_graphs import DEFAULT_BUCKETS  # noqa: E402
from engine.loader import load_or_restore, stash_weights, weight_files  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.warm_tier import WarmTier  # noqa: E402


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


def load_once(core: EngineCore, model_dir: str) -> dict:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    info = core.load_model("m", model_dir, max_model_len=4096, max_num_seqs=256)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    core.add_request("q", "m", list(range(100, 116)), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while core.has_unfinished_requests():
        core.step()
    t2 = time.perf_counter()
    g = core._slots["m"].runner.graphs
    return {"load_s": t1 - t0, "to_first_token_s": t2 - t0, "weight_gb": info.device_bytes / 1e9,
            "graph_capture_s": g.capture_seconds if g else None, "graph_warmup_s": g.warmup_seconds if g else None}


def main() -> int:
    model_dir = sys.argv[1]
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(os.environ.get("OUT", ".")) / "engine_load.json"
    files = weight_files(model_dir)
    size = sum(f.stat().st_size for f in files)
    tier = WarmTier(size + (1 << 30))
    source: dict[str, str] = {}

    def loader(model, d, *_ignored):  # core's load path, on this bench's tier under the key "m"
        torch.cuda.synchronize()
        t = time.perf_counter()
        nbytes, source["last"] = load_or_restore(model, d, tier, "m")
        torch.cuda.synchronize()
        source["weights_s"] = time.perf_counter() - t
        return nbytes, source["last"]

    # core.py calls load_or_restore(model, dir, its tier, key) (older cores: load_weights(model, dir))
    core_mod.load_or_restore = loader
    core_mod.load_weights = lambda model, d: loader(model, d)[0]
    core = EngineCore(device="cuda", decode_buckets=DEFAULT_BUCKETS)
    res: dict = {"model_dir": str(model_dir), "file_bytes": size, "gpu": torch.cuda.get_device_name()}
    res["dd"] = dd_rate(max(files, key=lambda f: f.stat().st_size), files)
    warm(files)
    load_once(core, model_dir)  # first load: Triton compiles land in the cache
    core.unload_model("m")
    warm(files)
    res["page_cache_warm"] = load_once(core, model_dir) | {"source": source["last"], "weights_s": source["weights_s"]}
    slot = core._slots["m"]
    t = time.perf_counter()
    stash_weights(tier, "m", slot.model)
    res["warm_tier_put_s"] = time.perf_counter() - t
    del slot
    core.unload_model("m")
    res["warm_tier"] = load_once(core, model_dir) | {"source": source["last"], "weights_s": source["weights_s"]}
    core.unload_model("m")
    tier.discard("m")
    dropped_gbs = 0.0
    if os.environ.get("LOAD_SKIP_DROPPED") != "1":
        res["drop_method"] = drop_caches(files)
        res["page_cache_dropped"] = load_once(core, model_dir) | {"source": source["last"],
                                                                  "weights_s": source["weights_s"]}
        core.unload_model("m")
        dropped_gbs = size / res["page_cache_dropped"]["load_s"] / 1e9
        res["dropped_vs_dd"] = dropped_gbs / res["dd"]["gb_s"] if "gb_s" in res["dd"] else None
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"{'case':<20} {'load s':>8} {'1st tok s':>10} {'weights s':>10} {'capture s':>10} source")
    for k in ("page_cache_warm", "warm_tier", "page_cache_dropped"):
        r = res.get(k)
        if r:
            print(f"{k:<20} {r['load_s']:>8.3f} {r['to_first_token_s']:>10.3f} {r['weights_s']:>10.3f} "
                  f"{r['graph_capture_s'] or 0:>10.3f} {r['source']}")
    print(f"dd {res['dd'].get('gb_s', 0):.2f} GB/s; dropped load at {dropped_gbs:.2f} GB/s "
          f"({(res.get('dropped_vs_dd') or 0) * 100:.0f}% of dd); warm-tier put {res['warm_tier_put_s']:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

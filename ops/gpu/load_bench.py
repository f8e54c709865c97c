"""Time weight loading paths on the GPU; print a table last, write JSON.

Usage: ``python ops/gpu/load_bench.py [GiB=4] [out.json]`` (default ``$OUT/load_bench.json``).
Writes a random bf16 safetensors file of GiB size under $TMPDIR (deleted at the end), then times,
each checked byte-exact against the file: safetensors ``load_file(device="cuda")``;
``stream_to_device`` at several thread counts, page cache warm and dropped (the file's pages are
dropped with ``posix_fadvise(DONTNEED)``, which needs no root); page cache warm, a sweep of reader
threads × chunk size, alone and beside a thread that holds the GIL in pure Python the way a
runner's build does during a restart's load; the warm tier's restore (pinned host → device); and a
``dd``-style sequential read of the cold file for the disk's own rate.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from cache.safetensors_check import check_file  # noqa: E402
from engine.weights.warm_tier import WarmTier  # noqa: E402
from engine.weights.weight_stream import CopyJob, stream_to_device  # noqa: E402


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_rate(path: Path) -> float:
    drop_cache(path)
    buf = bytearray(64 << 20)
    t = time.perf_counter()
    n = 0
    with open(path, "rb", buffering=0) as f:
        while (k := f.readinto(buf)) > 0:
            n += k
    return n / (time.perf_counter() - t) / 1e9


def main() -> int:
    if not torch.cuda.is_available():
        print("load_bench: needs CUDA", file=sys.stderr)
        return 2
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 4.0
    out_path = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(os.environ.get("OUT", ".")) / "load_bench.json"
    rows = []
    with tempfile.TemporaryDirectory() as td:
        path = Path(td) / "model.safetensors"
        n_t = 32
        numel = int(gib * (1 << 30) / 2 / n_t)
        cols = 4096
        tensors = {f"w{i}": torch.randn(numel // cols, cols, device="cuda").bfloat16().cpu() for i in range(n_t)}
        save_file(tensors, str(path))
        total = sum(t.numel() * 2 for t in tensors.values())
        info = {x.name: x for x in check_file(path).tensors}
        dst = {k: torch.empty_like(t, device="cuda") for k, t in tensors.items()}
        jobs = [CopyJob(path, info[k].begin, info[k].end - info[k].begin, d) for k, d in dst.items()]

        def check() -> bool:
            ok = all(torch.equal(dst[k].cpu(), tensors[k]) for k in list(tensors)[:: max(1, n_t // 4)])
            for d in dst.values():
                d.fill_(float("nan"))
            return ok

        def timed(label, fn, cold):
            if cold:
                drop_cache(path)
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            s = time.perf_counter() - t
            rows.append({"path": label, "cache": "dropped" if cold else "warm", "s": s, "GB/s": total / s / 1e9,
                         "ok": check()})

        disk = read_rate(path)
        rows.append({"path": "sequential read (dd-like)", "cache": "dropped", "s": total / disk / 1e9, "GB/s": disk,
                     "ok": True})
        for cold in (False, True):
            def st_load():
                got = load_file(str(path), device="cuda")
                for k, d in dst.items():
                    d.copy_(got[k])
            timed("safetensors load_file(cuda)", st_load, cold)
            for threads in (1, 4, 8):
                timed(f"stream_to_device threads={threads}",
                      lambda th=threads: stream_to_device(jobs, threads=th, streams=2), cold)
        for busy in (False, True):
            for threads in (4, 8, 12, 16):
                for chunk_mib in (8, 16, 32):
                    stop = threading.Event()

                    def spin():
                        n = 0
                        while not stop.is_set():
                            n += 1  # pure Python: holds the GIL between switch intervals
                    side = threading.Thread(target=spin, daemon=True) if busy else None
                    if side is not None:
                        side.start()
                    timed(f"sweep threads={threads} chunk={chunk_mib}MiB{' +busy thread' if busy else ''}",
                          lambda th=threads, c=chunk_mib: stream_to_device(jobs, threads=th, streams=2,
                                                                           chunk_bytes=c << 20), False)
                    stop.set()
                    if side is not None:
                        side.join()
        tier = WarmTier(int(total * 1.1))
        t = time.perf_counter()
        tier.put("m", {k: torch.randn_like(v, dtype=torch.float32).bfloat16() for k, v in dst.items()})
        put_s = time.perf_counter() - t
        ref = tier.get("m")
        t = time.perf_counter()
        tier.restore("m", dst)
        s = time.perf_counter() - t
        ok = all(torch.equal(dst[k].cpu(), ref[k]) for k in list(dst)[:4])
        rows.append({"path": f"warm tier restore (put took {put_s:.2f}s)", "cache": "pinned RAM", "s": s,
                     "GB/s": total / s / 1e9, "ok": ok})
    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "gpu": torch.cuda.get_device_name(0),
              "bytes": total, "rows": rows}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2))
    print(f"\n{report['gpu']}  {total / 1e9:.2f} GB bf16 safetensors  -> {out_path}")
    print(f"{'path':44s} {'cache':>10s} {'s':>7s} {'GB/s':>7s}  check")
    for r in rows:
        print(f"{r['path']:44s} {r['cache']:>10s} {r['s']:7.3f} {r['GB/s']:7.2f}  {'ok' if r['ok'] else 'MISMATCH'}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

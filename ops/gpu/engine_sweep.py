"""Step-shape sweep of the offline bench in one process, plus the Triton launch cost, on the GPU.

Usage (repo root, GPU machine): ``python3 ops/gpu/engine_sweep.py MODEL_DIR OUT_JSON [--peer N]``.

1. Host microseconds per launch of the fused add+RMSNorm wrapper, the cached launcher off and on
   (same kernel, outputs compared bit for bit).
2. ``--peer N``: transformers ``generate_batch`` on the first N requests (subprocess, before any
   engine holds GPU memory).
3. The sharegpt-like offline bench (1000 requests at once) at the current defaults (2048-token
   steps, 256 sequences) with batch-1 decode, then at ``max_num_batched_tokens`` in CONFIGS x
   ``max_num_seqs`` in (256, 512); each config is a fresh EngineCore in this process (memory of
   the last one released first, the KV pages each got are recorded).
Everything lands in one JSON; a table is printed last.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from ops.bench.engine_bench import _commit, _run_peer, run_bench  # noqa: E402

# the old default first (with batch-1), then the rest, the likeliest winners first
CONFIGS = [(2048, 256), (8192, 512), (4096, 512), (16384, 512), (8192, 256), (4096, 256), (16384, 256)]


def launch_cost(n: int = 3000) -> dict:
    from engine.kernels import norm_triton as nt

    x, r = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16), torch.randn(256, 4096, device="cuda",
                                                                                      dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    out, res = torch.empty_like(x), torch.empty_like(x)
    lau = nt._RMS_NORM_LAUNCH
    res_us = {}
    outs = {}
    for enabled in (False, True, False, True):
        lau.enabled = enabled
        for _ in range(20):
            nt.rms_norm_triton(x, r, w, 1e-5, out=out, res_out=res)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            nt.rms_norm_triton(x, r, w, 1e-5, out=out, res_out=res)
        host = (time.perf_counter() - t) / n * 1e6
        torch.cuda.synchronize()
        res_us.setdefault("fast" if enabled else "normal", []).append(host)
        outs[enabled] = (out.clone(), res.clone())
    lau.enabled = True
    same = all(torch.equal(a, b) for a, b in zip(outs[False], outs[True]))
    return {"host_us_per_call_normal": min(res_us["normal"]), "host_us_per_call_fast": min(res_us["fast"]),
            "bitwise_equal": same, "hits": lau.hits, "misses": lau.misses}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--peer", type=int, default=0)
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--configs", help="TOKENSxSEQS,... (default: the sweep's list)")
    ap.add_argument("--no-launch", action="store_true", help="skip the launch-cost micro bench")
    a = ap.parse_args()
    res: dict = {"commit": _commit(), "gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                               time.gmtime())}
    res["launch"] = {} if a.no_launch else launch_cost()
    print("launch", res["launch"], flush=True)
    configs = [tuple(int(x) for x in c.split("x")) for c in a.configs.split(",")] if a.configs else CONFIGS
    if a.peer:
        res["peer"] = _run_peer(a.model_dir, a.peer, 110)
        print("peer", res["peer"], flush=True)
    runs = []
    for i, (tokens, seqs) in enumerate(configs):
        gc.collect()
        torch.cuda.empty_cache()
        t = time.perf_counter()
        try:
            r = run_bench(a.model_dir, a.num_requests, "cuda", seqs, tokens, 2048, 16, batch1=i == 0)
        except Exception as e:  # one config failing must not lose the others
            r = {"error": f"{type(e).__name__}: {e}"}
        r["config"] = {"max_num_batched_tokens": tokens, "max_num_seqs": seqs}
        r["bench_wall_s"] = time.perf_counter() - t
        if a.peer and r.get("total_tok_s") and (res.get("peer") or {}).get("total_tok_s"):
            r["vs_peer_total_tok_s"] = r["total_tok_s"] / res["peer"]["total_tok_s"]
        runs.append(r)
        print("run", tokens, seqs, {k: r.get(k) for k in ("total_tok_s", "req_s", "tpot_ms_p50", "host_ms_by_kind",
                                                          "steps_by_kind", "error")}, flush=True)
        Path(a.out).write_text(json.dumps(res | {"runs": runs}, indent=2) + "\n")
    print(f"\n{'tokens':>6} {'seqs':>4} {'tok/s':>8} {'req/s':>6} {'TTFT50':>7} {'TPOT50':>6} {'eager':>6} "
          f"{'ms/eager':>8} {'host/eager':>10} {'graph':>6} {'ms/graph':>8} {'pages':>6}")
    for r in runs:
        c = r["config"]
        if "error" in r:
            print(f"{c['max_num_batched_tokens']:>6} {c['max_num_seqs']:>4} {r['error'][:80]}")
            continue
        sk, hk = r["steps_by_kind"], r["host_ms_by_kind"]
        print(f"{c['max_num_batched_tokens']:>6} {c['max_num_seqs']:>4} {r['total_tok_s']:>8.0f} {r['req_s']:>6.1f} "
              f"{r['ttft_ms_p50']:>7.0f} {r['tpot_ms_p50']:>6.1f} {sk['eager']['steps']:>6} "
              f"{sk['eager']['ms_mean'] or 0:>8.1f} {hk['eager_ms_per_step']:>10.2f} {sk['graph']['steps']:>6} "
              f"{sk['graph']['ms_mean'] or 0:>8.2f} {r['engine']['kv_pages']:>6}")
    b1 = runs[0].get("batch1") or {}
    print("batch1 ms/token p50", b1.get("decode_ms_per_token_p50"), "peer", (res.get("peer") or {}).get("total_tok_s"),
          "launch us normal/fast", res["launch"].get("host_us_per_call_normal"),
          res["launch"].get("host_us_per_call_fast"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Measure what the sandbox costs: syscalls, file opens, a torch matmul loop and engine decode.

``python -m sandbox.overhead --model-dir DIR [--rounds 3]`` runs the same workload in fresh
processes, alternately unconfined and confined (:func:`sandbox.launch.confine` with the
worker's default policy, applied after the model is loaded, as the worker does), and prints
the medians and the relative overhead as JSON. The model dir is any folder ``make-model``
wrote; its parent is the policy's cache dir.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from sandbox.launch import confine, default_policy


def _per_call_ns(fn: Any, n: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - t0) / n


def _child(mode: str, model_dir: str, runtime_dir: str) -> dict[str, Any]:
    import torch

    from engine.llm import LLM
    from engine.sampling import SamplingParams

    torch.set_num_threads(1)  # one core: less noise on a shared machine
    llm = LLM(model_dir, device="cpu", max_model_len=512, max_num_seqs=16, seed=0)
    probe_file = os.path.join(model_dir, "config.json")
    report = None
    if mode == "on":
        report = confine(default_policy(os.path.dirname(model_dir), runtime_dir)).to_dict()["active"]
    a = torch.randn(384, 384)
    _ = a @ a  # warm-up
    out: dict[str, Any] = {"mode": mode, "active": report}
    out["getppid_ns"] = _per_call_ns(os.getppid, 200_000)
    out["stat_ns"] = _per_call_ns(lambda: os.stat(probe_file), 50_000)

    def open_close() -> None:
        os.close(os.open(probe_file, os.O_RDONLY))

    out["open_close_ns"] = _per_call_ns(open_close, 50_000)
    t0 = time.perf_counter()
    for _ in range(200):
        _ = a @ a
    out["matmul_ms"] = (time.perf_counter() - t0) / 200 * 1e3
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    prompts = [[100 + i + j for j in range(24)] for i in range(8)]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), detokenize=False)
    t0 = time.perf_counter()
    results = llm.generate(prompts, params, detokenize=False)
    dt = time.perf_counter() - t0
    out["engine_tok_s"] = sum(len(r.token_ids) for r in results) / dt
    return out


def measure(model_dir: str, rounds: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="infire-overhead-") as rt:
        for _ in range(rounds):
            for mode in ("off", "on"):
                proc = subprocess.run([sys.executable, "-m", "sandbox.overhead", "--child", mode, "--model-dir", model_dir,
                                       "--runtime-dir", rt], capture_output=True, text=True, env=env, timeout=600)
                if proc.returncode != 0:
                    raise RuntimeError(f"overhead child ({mode}) failed:\n{proc.stderr[-2000:]}")
                runs[mode].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    keys = ("getppid_ns", "stat_ns", "open_close_ns", "matmul_ms", "engine_tok_s")
    med = {m: {k: statistics.median(r[k] for r in runs[m]) for k in keys} for m in runs}
    overhead = {}
    for k in keys:
        off, on = med["off"][k], med["on"][k]
        # Throughput: fewer is worse; times: more is worse. Positive = the sandbox costs this much.
        overhead[k] = ((off - on) / off if k.endswith("_s") else (on - off) / off) * 100
    return {"rounds": rounds, "median_off": med["off"], "median_on": med["on"], "overhead_pct": overhead,
            "active": runs["on"][0]["active"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sandbox.overhead", description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", choices=("on", "off"), help=argparse.SUPPRESS)
    ap.add_argument("--runtime-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    model_dir = os.path.abspath(args.model_dir)
    if args.child:
        print(json.dumps(_child(args.child, model_dir, args.runtime_dir)))
        return 0
    print(json.dumps(measure(model_dir, args.rounds), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

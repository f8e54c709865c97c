"""Measure what the sandbox costs: syscalls, file opens, a torch matmul and engine decode.

``python ops/bench/sandbox_overhead.py --model-dir DIR [--pairs 15]`` starts two long-lived workers, one
unconfined and one confined (:func:`sandbox.launch.confine` with the worker's default policy,
applied after the model is loaded, as the engine worker does), and has them run the same short
block of work back to back, alternating who goes first, ``--pairs`` times per workload. Each
pair runs within a fraction of a second, so load from other processes hits both sides alike;
the overhead is the median of the per-pair ratios. The model dir is any folder ``make-model``
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
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from sandbox.launch import confine  # noqa: E402
from sandbox.policy import default_policy  # noqa: E402

WORKLOADS = ("getppid_ns", "stat_ns", "open_close_ns", "matmul_ms", "engine_tok_s")


def _per_call_ns(fn: Callable[[], object], n: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - t0) / n


def _serve(mode: str, model_dir: str, runtime_dir: str) -> None:
    """Child: load the model, confine if asked, then answer one block per stdin line."""
    import torch

    from engine.llm import LLM
    from engine.sampling import SamplingParams

    torch.set_num_threads(1)  # one core each: the two sides must not fight over threads
    llm = LLM(model_dir, device="cpu", max_model_len=512, max_num_seqs=16, seed=0)
    probe_file = os.path.join(model_dir, "config.json")
    active: list[str] = []
    if mode == "on":
        active = confine(default_policy(os.path.dirname(model_dir), runtime_dir)).active
    a = torch.randn(384, 384)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = [[100 + i + j for j in range(16)] for i in range(8)]

    def engine() -> float:
        t0 = time.perf_counter()
        results = llm.generate(prompts, params, detokenize=False)
        return sum(len(r.token_ids) for r in results) / (time.perf_counter() - t0)

    blocks: dict[str, Callable[[], float]] = {
        "getppid_ns": lambda: _per_call_ns(os.getppid, 20_000),
        "stat_ns": lambda: _per_call_ns(lambda: os.stat(probe_file), 5_000),
        "open_close_ns": lambda: _per_call_ns(lambda: os.close(os.open(probe_file, os.O_RDONLY)), 5_000),
        "matmul_ms": lambda: _per_call_ns(lambda: a @ a, 20) / 1e6,
        "engine_tok_s": engine,
    }
    for fn in blocks.values():
        fn()  # warm-up
    print(json.dumps({"ready": mode, "active": active}), flush=True)
    for line in sys.stdin:
        name = line.strip()
        if name == "quit":
            return
        print(json.dumps({name: blocks[name]()}), flush=True)


class _Side:
    def __init__(self, mode: str, model_dir: str, runtime_dir: str) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", mode, "--model-dir", model_dir,
                                      "--runtime-dir", runtime_dir], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        self.hello = self._read()

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            raise RuntimeError(f"overhead worker exited ({self.proc.wait()})")
        return json.loads(line)

    def run(self, name: str) -> float:
        if self.proc.stdin is None:
            raise RuntimeError("overhead worker has no stdin")
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()
        return float(self._read()[name])

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        self.proc.wait(30)


def measure(model_dir: str, pairs: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="infire-overhead-") as rt:
        off, on = _Side("off", model_dir, rt), _Side("on", model_dir, rt)
        try:
            vals: dict[str, dict[str, list[float]]] = {w: {"off": [], "on": []} for w in WORKLOADS}
            for w in WORKLOADS:
                for i in range(pairs):
                    for side, mode in ((off, "off"), (on, "on")) if i % 2 == 0 else ((on, "on"), (off, "off")):
                        vals[w][mode].append(side.run(w))
        finally:
            off.close()
            on.close()
    result: dict[str, Any] = {"pairs": pairs, "active": on.hello["active"], "median_off": {}, "median_on": {}, "overhead_pct": {}}
    for w in WORKLOADS:
        a, b = vals[w]["off"], vals[w]["on"]
        # Positive = the sandbox costs this much: more time per call, or fewer tokens per second.
        ratios = [(y / x - 1) if not w.endswith("_s") else (1 - y / x) for x, y in zip(a, b)]
        result["median_off"][w] = statistics.median(a)
        result["median_on"][w] = statistics.median(b)
        result["overhead_pct"][w] = 100 * statistics.median(ratios)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python ops/bench/sandbox_overhead.py", description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--pairs", type=int, default=15)
    ap.add_argument("--serve", choices=("on", "off"), help=argparse.SUPPRESS)
    ap.add_argument("--runtime-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    model_dir = os.path.abspath(args.model_dir)
    if args.serve:
        _serve(args.serve, model_dir, args.runtime_dir)
        return 0
    print(json.dumps(measure(model_dir, args.pairs), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Several models on one device under one budget (issue 7): swap time, sharing cost, fairness.

Two big models of one shape (A, B) and one small (C) in one in-process EngineCore whose budget
holds two big models but not all three. Measures, and prints one JSON result:

- ``load``: first loads of A and B (seconds; from disk or the page cache, whatever it is);
- ``refusal``: the load of C refused with the numbers, and the plan with A, B offered (LRU A);
- ``swap``: unload A, load C (page cache), unload C, load A again (page cache, or the warm tier
  when the engine has one: ``warm_tier`` tells which);
- ``throughput``: A alone, B alone, A and B together, offline (every request added at t0),
  output tok/s; ``together_vs_alone`` = together / mean(alone);
- ``ttft``: a quiet model's time to first token alone, and next to a flooded one (the flood
  kept at ``--flood`` requests in flight); ``ratio`` = median flooded / median solo.

    python -m ops.bench.multi_model_bench --device cpu                      (tiny models, CI box)
    python -m ops.bench.multi_model_bench --device cuda --preset llama-3.1-8b --small-preset small \\
        --work /tmp/mm --num-requests 256 --gen-len 128 --flood 128          (the H200 run)
    python -m ops.bench.multi_model_bench --big A_DIR B_DIR --small C_DIR --device cuda

Model folders are generated (random weights, ``engine.modelgen``) under ``--work`` unless given.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.core import EngineCore, LoadRefused
from engine.sampling import SamplingParams


def make_models(work: Path, arch: str, preset: str, small_arch: str, small_preset: str) -> dict[str, Path]:
    """A and B (same shape, different seeds) and C, generated once under ``work``."""
    from engine.modelgen import make_model

    out = {}
    for name, (a, p, seed) in {"A": (arch, preset, 0), "B": (arch, preset, 1),
                               "C": (small_arch, small_preset, 2)}.items():
        d = work / f"{name}-{a}-{p}-s{seed}"
        if not (d / "config.json").is_file():
            make_model(d, a, p, seed=seed, device="cpu")
        out[name] = d
    return out


class Bench:
    """One engine and the knobs every phase shares."""

    def __init__(self, a: argparse.Namespace, dirs: dict[str, Path]) -> None:
        self.a = a
        self.dirs = dirs
        self.rng = random.Random(a.seed)
        probe = EngineCore(device=a.device, max_num_batched_tokens=a.max_num_batched_tokens,
                           memory_budget=a.probe_budget)
        self.needs = {n: probe.check_load(n, d, a.max_model_len, a.max_num_seqs).needed for n, d in dirs.items()}
        del probe
        big = max(self.needs["A"], self.needs["B"])
        # Holds two big models (and their KV minimums) but not a third model beside them.
        self.budget = a.budget or 2 * big + self.needs["C"] // 2
        self.core = EngineCore(device=a.device, max_num_batched_tokens=a.max_num_batched_tokens,
                               memory_budget=self.budget, decode_buckets=tuple(a.decode_buckets), seed=a.seed,
                               warm_tier_bytes=a.warm_tier_bytes)
        self.vocab: dict[str, int] = {}
        self._n = 0

    def load(self, name: str) -> float:
        t0 = time.perf_counter()
        info = self.core.load_model(name, self.dirs[name], max_model_len=self.a.max_model_len,
                                    max_num_seqs=self.a.max_num_seqs)
        self.vocab[name] = info.vocab_size
        return time.perf_counter() - t0

    def unload(self, name: str) -> float:
        t0 = time.perf_counter()
        self.core.unload_model(name)
        while self.core.has_unfinished_requests():  # flush the abort outputs
            self.core.step()
        return time.perf_counter() - t0

    def add(self, model: str, gen_len: int) -> str:
        self._n += 1
        rid = f"{model}-{self._n}"
        prompt = [self.rng.randrange(10, self.vocab[model]) for _ in range(self.a.prompt_len)]
        self.core.add_request(rid, model, prompt, SamplingParams(temperature=0, max_tokens=gen_len, ignore_eos=True))
        return rid

    def offline(self, models: list[str], n: int | None = None) -> dict[str, Any]:
        """Every request added at t0, stepped to the end: output tok/s, total and per model."""
        for m in models:
            for _ in range(self.a.num_requests if n is None else n):
                self.add(m, self.a.gen_len)
        per = dict.fromkeys(models, 0)
        t0 = time.perf_counter()
        while self.core.has_unfinished_requests():
            for o in self.core.step():
                per[o.req_id.split("-")[0]] += len(o.new_token_ids)
        wall = time.perf_counter() - t0
        return {"seconds": wall, "output_tok_s": sum(per.values()) / wall,
                "per_model_tok_s": {m: n / wall for m, n in per.items()}}

    def ttft(self, quiet: str, flood: str | None) -> list[float]:
        """Seconds from add to first token of ``--trickle`` short quiet requests, one at a time;
        with ``flood``, that model is kept at ``--flood`` requests in flight meanwhile."""
        out = []
        live: set[str] = set()
        for _ in range(self.a.trickle):
            if flood is not None:
                while len(live) < self.a.flood:
                    live.add(self.add(flood, self.a.gen_len))
                for _ in range(self.a.settle_steps):  # the flood is mid-stream when the quiet one arrives
                    for o in self.core.step():
                        if o.finish_reason:
                            live.discard(o.req_id)
            rid = self.add(quiet, 2)
            t0 = time.perf_counter()
            first = None
            done = False
            while not done:
                for o in self.core.step():
                    if o.req_id == rid:
                        first = first if first is not None else time.perf_counter() - t0
                        done = o.finish_reason is not None
                    elif o.finish_reason:
                        live.discard(o.req_id)
            out.append(first)
        for rid in live:
            self.core.abort_request(rid)
        while self.core.has_unfinished_requests():
            self.core.step()
        return out


def run(a: argparse.Namespace, dirs: dict[str, Path]) -> dict[str, Any]:
    b = Bench(a, dirs)
    res: dict[str, Any] = {"budget_bytes": b.budget, "needs_bytes": b.needs, "device": str(b.core.device),
                           "models": {n: str(d) for n, d in dirs.items()}}
    res["load"] = {"A_s": b.load("A"), "B_s": b.load("B")}
    try:
        b.core.load_model("C", dirs["C"], max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs)
        res["refusal"] = {"refused": False}
        b.unload("C")
    except LoadRefused as e:
        plan = b.core.check_load("C", dirs["C"], a.max_model_len, a.max_num_seqs, evictable=["A", "B"])
        res["refusal"] = {"refused": True, "needed": e.needed, "free": e.free, "short": e.short,
                          "plan_evict": list(plan.evict), "message": str(e)}
    b.offline(["A", "B"], a.warmup_requests)  # first steps (allocator, kernels) are not measured
    res["throughput"] = {"A_alone": b.offline(["A"]), "B_alone": b.offline(["B"]),
                         "together": b.offline(["A", "B"])}
    t = res["throughput"]
    alone = statistics.mean([t["A_alone"]["output_tok_s"], t["B_alone"]["output_tok_s"]])
    t["together_vs_alone"] = t["together"]["output_tok_s"] / alone
    solo, flooded = b.ttft("B", None), b.ttft("B", "A")
    res["ttft"] = {"solo_s": solo, "flooded_s": flooded, "solo_median_s": statistics.median(solo),
                   "flooded_median_s": statistics.median(flooded),
                   "ratio": statistics.median(flooded) / statistics.median(solo)}
    swap = {"unload_A_s": b.unload("A"), "load_C_s": b.load("C"), "unload_C_s": b.unload("C"),
            "reload_A_s": b.load("A")}
    swap["warm_tier"] = getattr(b.core, "warm_tier", None) is not None
    res["swap"] = swap
    res["memory"] = b.core.memory()
    b.core.pool.audit()
    return res


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="multi_model_bench", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--big", nargs=2, metavar="DIR", help="folders of A and B (same shape)")
    p.add_argument("--small", metavar="DIR", help="folder of C")
    p.add_argument("--arch", default="llama")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--small-arch", default="qwen3")
    p.add_argument("--small-preset", default="tiny")
    p.add_argument("--work", type=Path, help="where generated models go (default: a temp dir)")
    p.add_argument("--budget", type=int, help="bytes (default: two big models' needs + half the small's)")
    p.add_argument("--probe-budget", type=int, default=None, help="budget of the planning engine")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--decode-buckets", type=int, nargs="*", default=[])
    p.add_argument("--num-requests", type=int, default=16, help="per model, offline phase")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--flood", type=int, default=16, help="flood requests kept in flight")
    p.add_argument("--trickle", type=int, default=5, help="quiet requests measured")
    p.add_argument("--warmup-requests", type=int, default=4, help="per model, before measuring")
    p.add_argument("--settle-steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warm-tier-bytes", type=int, default=0, help="pinned host RAM for unloaded weights")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    with tempfile.TemporaryDirectory(prefix="mm-bench-") as tmp:
        if a.big and a.small:
            dirs = {"A": Path(a.big[0]), "B": Path(a.big[1]), "C": Path(a.small)}
        else:
            dirs = make_models(a.work or Path(tmp), a.arch, a.preset, a.small_arch, a.small_preset)
        res = run(a, dirs)
    text = json.dumps(res, indent=2, default=str)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

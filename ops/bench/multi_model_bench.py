"""Several models on one device under one budget (issue 7): swap time, sharing cost, fairness.

Two big models of one shape (A, B) and one small (C) in one in-process EngineCore (no HTTP) whose
budget holds A and B, each with ``--kv-gib`` of KV reserved, but not C beside them. Phases, in order:

1. ``load``: A then B (the first load of a process compiles kernels); ``refusal``: C refused
   before the device is touched, with the numbers, and the plan offered (evict A, the LRU one).
2. ``warm_up`` (not timed): every decode bucket run once per model (graphs captured), then
   sharegpt-like traffic on both; ``engine.per_model.*.deferred_graphs_before`` of each later
   phase shows that no graph was left to capture inside a timed window.
3. ``saturated``: ``--num-requests`` sharegpt-like requests (ops/bench/workload.py, engine_bench's
   workload) per model, all added at t0: A alone, B alone, A and B together.
   ``together_vs_alone`` = together total tok/s / mean of the two alone (goal ≥ 0.90).
4. ``light``: open loop, each model's requests (``--prompt-len`` → ``--gen-len`` tokens) due at
   ``--light-rate`` per second (seeded Poisson, the same schedule solo and together) for
   ``--light-duration`` s; delivered output tok/s inside [``--light-ramp``, duration), TTFT,
   TPOT, mean requests in flight. A solo, B solo, both together; ratio together / solo per
   model (goal ≥ 0.90 on delivered tok/s; the TPOT ratio is the cost of sharing).
5. ``ttft``: B quiet (``--trickle`` requests, one due every ``--ttft-interval`` s), alone and
   next to A kept at each ``--flood`` level of sharegpt-like requests in flight; ratio of
   medians flooded / solo (goal ≤ 2).
6. ``swap``: A out (into the warm tier), C in; C out, A in from the warm tier (goal: the swap
   ≤ 1 s); A out and in again from its files (page cache) with the warm tier set aside.

Each timed phase records its step() calls and, per model, engine steps (graph / eager), host ms
per step and wall ms per engine step, so a low figure can be explained from the JSON alone.

    python -m ops.bench.multi_model_bench --device cuda --big /tmp/m8b /tmp/m8b --small /tmp/msmall \\
        --kv-gib 36 --warm-tier-bytes 42949672960 --out mm.json     (the H200 run, ops/gpu/serve_multi.sh)
    python -m ops.bench.multi_model_bench --device cpu --max-model-len 256 --max-num-seqs 8 \\
        --max-num-batched-tokens 512 --sat-duration 3 --sat-ramp 1 --light-duration 3 --light-ramp 1 \\
        --prompt-len 32 --gen-len 16 --flood 8 --trickle 5 --ttft-interval 0.1   (tiny models, ~30 s)

Model folders are generated (random weights, ``modelgen.make``) under ``--work`` unless given.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import shlex
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.core.ledger import LoadRefused
from engine.load_spec import LoadSpec
from ops.bench.engine_bench import _commit, _device_name
from ops.bench.multi_model_phases import Bench, light_ratios
from ops.bench.multi_model_setup import make_models, plan_budget, ratio
from ops.bench.multi_model_summary import goals, summary


def _phase_saturated(b: Bench, res: dict[str, Any]) -> None:
    work, dropped = {}, {}
    for i, m in enumerate(("A", "B")):
        work[m], dropped[m] = b.sharegpt(m, b.a.num_requests, b.a.seed + i)
    a = b.a
    t = {"workload": "sharegpt-like", "mode": a.sat_mode, "distinct_requests_per_model": {m: len(w) for m, w in work.items()},
         "dropped_longer_than_max_model_len": dropped, "in_flight_per_model": a.sat_in_flight if a.sat_mode == "steady" else None,
         "duration_s": a.sat_duration, "window_s": [a.sat_ramp, a.sat_duration],
         "A_alone": b.saturated(["A"], work), "B_alone": b.saturated(["B"], work),
         "together": b.saturated(["A", "B"], work)}
    alone = statistics.mean([t["A_alone"]["total_tok_s"], t["B_alone"]["total_tok_s"]])
    alone_out = statistics.mean([t["A_alone"]["output_tok_s"], t["B_alone"]["output_tok_s"]])
    t["together_vs_alone"] = t["together"]["total_tok_s"] / alone
    t["together_vs_alone_output"] = t["together"]["output_tok_s"] / alone_out
    res["saturated"] = t


def _phase_light(b: Bench, res: dict[str, Any]) -> None:
    a = b.a
    sched = {m: b.arrivals(m, i) for i, m in enumerate(("A", "B"))}
    solo = {"A": b.light(["A"], sched), "B": b.light(["B"], sched)}
    both = b.light(["A", "B"], sched)
    sat = res.get("saturated", {})
    frac = {m: ratio(solo[m]["per_model"][m]["offered_tok_s"], sat[f"{m}_alone"]["output_tok_s"])
            for m in ("A", "B") if f"{m}_alone" in sat}
    res["light"] = {"rate_per_model_req_s": a.light_rate, "arrivals": a.light_arrivals,
                    "duration_s": a.light_duration, "window_s": [a.light_ramp, a.light_duration],
                    "prompt_len": a.prompt_len, "gen_len": a.gen_len,
                    "offered_vs_saturated_alone_output": frac,
                    "A_solo": solo["A"], "B_solo": solo["B"], "together": both,
                    "together_vs_solo": light_ratios(solo, both)}


def _phase_ttft(b: Bench, res: dict[str, Any]) -> None:
    a = b.a
    flood_work, _ = b.sharegpt("A", max(256, 4 * max(a.flood)), a.seed + 200)
    solo = b.ttft("B", None, 0, flood_work)
    out: dict[str, Any] = {"quiet": "B", "flooded": "A", "prompt_len": a.prompt_len, "interval_s": a.ttft_interval,
                           "lead_s": a.ttft_lead, "solo": solo, "flooded_by": {}}
    for n in a.flood:
        alone = b.ttft("B", "A", n, flood_work, trickle=False)["flood"]
        f = b.ttft("B", "A", n, flood_work)
        f["ratio_p50"] = ratio(f["p50_ms"], solo["p50_ms"])
        f["flood_alone"] = alone  # the flooded model with no quiet requests, same time and level
        f["flood_tok_s_vs_alone"] = ratio(f["flood"]["output_tok_s"], alone["output_tok_s"])
        out["flooded_by"][str(n)] = f
    res["ttft"] = out


def run(a: argparse.Namespace, dirs: dict[str, Path]) -> dict[str, Any]:
    plan = plan_budget(a, dirs)
    b = Bench(a, dirs, plan)
    res: dict[str, Any] = {"plan": plan.as_json(), "device": str(b.core.device), "gpu": _device_name(b.core),
                           "models": {n: str(d) for n, d in dirs.items()}}
    res["quiet_window_ms_used"] = b.core.options.quiet_window_ms  # what the engine ran with
    res["warm_tier_prepin_s"] = b.prepin_s  # the tier's RAM pinned once at start (untimed elsewhere)
    res["load"] = {"A": b.load("A"), "B": b.load("B")}
    res["plan"]["kv_tokens_per_big_model"] = plan.kv_pages * b.block["A"]
    try:
        b.core.load_model(LoadSpec("C", dirs["C"], max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs))
        res["refusal"] = {"refused": False}
        b.unload("C")
    except LoadRefused as e:
        plan_c = b.core.check_load(LoadSpec("C", dirs["C"], a.max_model_len, a.max_num_seqs), evictable=["A", "B"])
        res["refusal"] = {"refused": True, "needed": e.needed, "free": e.free, "short": e.short,
                          "plan_evict": list(plan_c.evict), "message": str(e)}
    res["warm_up"] = b.warm_up(["A", "B"])
    if "saturated" in a.phases:
        _phase_saturated(b, res)
    if "light" in a.phases:
        _phase_light(b, res)
    if "ttft" in a.phases:
        _phase_ttft(b, res)
    if "swap" in a.phases:
        res["swap"] = b.swaps()
    res["memory"] = dataclasses.asdict(b.core.memory())
    b.core.pools.pool.audit()
    res["goals"] = goals(res)
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
    p.add_argument("--phases", nargs="*", default=["saturated", "light", "ttft", "swap"],
                   choices=["saturated", "light", "ttft", "swap"])
    g = p.add_argument_group("engine and budget (defaults: engine_bench's best offline shape)")
    g.add_argument("--budget", type=int, help="bytes (default: needs of A + B with their KV, + half C's)")
    g.add_argument("--probe-budget", type=int, default=None, help="budget of the planning engine")
    g.add_argument("--kv-gib", type=float, help="KV reserved per big model (default: max-num-seqs longest sequences)")
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--max-num-seqs", type=int, default=512)
    g.add_argument("--max-num-batched-tokens", type=int, default=16384)
    g.add_argument("--decode-buckets", type=int, nargs="*", default=None, help="default: the engine's")
    g.add_argument("--warm-tier-bytes", type=int, default=0, help="pinned host RAM for unloaded weights")
    g.add_argument("--shared-step-tokens", type=int, default=512,
                   help="cap on a step's tokens while another model is active (0: none; the daemon's default 512)")
    g.add_argument("--quiet-window-ms", type=int, default=None,
                   help="EngineCore quiet_window_s in ms (default: the engine's, the daemon's 1000)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--cpu-threads", type=int, default=1, help="torch intra-op threads on the CPU (0: torch's)")
    w = p.add_argument_group("workloads")
    w.add_argument("--warmup-requests", type=int, default=64, help="sharegpt-like per model, not timed")
    w.add_argument("--num-requests", type=int, default=1000, help="sharegpt-like per model, saturated phase")
    w.add_argument("--sat-mode", choices=["steady", "offline"], default="steady",
                   help="steady: kept at --sat-in-flight for --sat-duration s; offline: all at t0, to the end")
    w.add_argument("--sat-in-flight", type=int, help="default: max-num-seqs + a quarter (a queue keeps the batch full)")
    w.add_argument("--sat-duration", type=float, default=12.0)
    w.add_argument("--sat-ramp", type=float, default=3.0, help="seconds not counted at the start")
    w.add_argument("--prompt-len", type=int, default=512, help="light and quiet requests")
    w.add_argument("--gen-len", type=int, default=128, help="light requests")
    w.add_argument("--light-rate", type=float, default=8.0, help="requests/s per model")
    w.add_argument("--light-arrivals", choices=["poisson", "even"], default="poisson")
    w.add_argument("--light-duration", type=float, default=12.0)
    w.add_argument("--light-ramp", type=float, default=2.0, help="seconds not counted at the start")
    w.add_argument("--flood", type=int, nargs="+", default=[128, 512], help="flood levels (requests in flight)")
    w.add_argument("--trickle", type=int, default=12, help="quiet requests measured per level")
    w.add_argument("--ttft-interval", type=float, default=0.25)
    w.add_argument("--ttft-lead", type=float, default=1.0, help="flood alone before the first quiet request")
    w.add_argument("--phase-timeout", type=float, default=60.0)
    p.add_argument("--out", type=Path, help="also write the JSON here")
    a = p.parse_args(argv)
    if a.sat_in_flight is None:
        a.sat_in_flight = a.max_num_seqs + a.max_num_seqs // 4
    if not 0 <= a.light_ramp < a.light_duration or not 0 <= a.sat_ramp < a.sat_duration:
        p.error("a ramp must be shorter than its duration")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    argv = sys.argv[1:] if argv is None else argv
    meta = {"command": "python -m ops.bench.multi_model_bench " + " ".join(shlex.quote(x) for x in argv),
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "commit": _commit()}
    with tempfile.TemporaryDirectory(prefix="mm-bench-") as tmp, cpu_threads(a):
        if a.big and a.small:
            dirs = {"A": Path(a.big[0]), "B": Path(a.big[1]), "C": Path(a.small)}
        else:
            dirs = make_models(a.work or Path(tmp), a.arch, a.preset, a.small_arch, a.small_preset)
        res = {**meta, "settings": settings(a), **run(a, dirs)}
    text = json.dumps(res, indent=2, default=str)
    if a.out:
        a.out.write_text(text + "\n")
    else:
        print(text)
    print(summary(res))
    return 0


@contextlib.contextmanager
def cpu_threads(a: argparse.Namespace) -> Iterator[None]:
    """On the CPU, ``--cpu-threads`` intra-op threads for the run (two spinning threads on a shared
    two-core box turn a 1.5 ms step into 175 ms whenever another process holds a core)."""
    import torch

    cpu = a.device == "cpu" or (a.device == "auto" and not torch.cuda.is_available())
    old = torch.get_num_threads()
    if cpu and a.cpu_threads:
        torch.set_num_threads(a.cpu_threads)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def settings(a: argparse.Namespace) -> dict[str, Any]:
    s = {k: v for k, v in vars(a).items() if k not in ("out", "work")}
    s["why"] = ("saturated phase at engine_bench's best offline shape on the H200 (16384-token steps, 512 "
                "sequences, max_model_len 2048, sharegpt-like; docs/perf.md); both models share the step "
                "settings, and each gets --kv-gib of KV reserved so the budget holds A and B but not C")
    return s


if __name__ == "__main__":
    sys.exit(main())

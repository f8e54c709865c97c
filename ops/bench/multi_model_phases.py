"""The multi-model bench's phases, each a time-driven loop around ``EngineCore.step()``.

Only the engine's public request interface is relied on: ``add_request``/``abort_request``,
outputs as ``step()`` returns them (a call need not be one device step, and the outputs of a step
may come back with a later call), ``has_unfinished_requests()``, ``load_model``/``unload_model``.
Every time is the client's: a request's TTFT runs from when it was due (open loop: a request due
during a long step is added late and that lateness counts) to the call that returned its first token.
"""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from engine.core.engine_core import EngineCore
from engine.options import EngineOptions
from engine.sampling import SamplingParams
from engine.load_spec import LoadSpec
from ops.bench.multi_model_setup import Plan, counter_delta, engine_counters, ratio
from ops.bench.workload import percentile as pct
from ops.bench.workload import BenchRequest, sharegpt_like

INF = float("inf")


def _quiet_window_ms(a: argparse.Namespace) -> int:
    """``--quiet-window-ms``; unset: the engine's default (the daemon's)."""
    ms = getattr(a, "quiet_window_ms", None)
    return EngineOptions().quiet_window_ms if ms is None else int(ms)


class Tracker:
    """What the client saw of each request; only ``step()`` outputs feed it."""

    def __init__(self, window: tuple[float, float] = (0.0, INF)) -> None:
        self.t0 = time.perf_counter()
        self.window = window  # seconds after t0: tokens returned inside it are counted apart
        self.model: dict[str, str] = {}
        self.due: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.ntok: Counter[str] = Counter()
        self.reason: dict[str, str] = {}
        self.live: dict[str, set[str]] = defaultdict(set)
        self.tokens: Counter[str] = Counter()
        self.window_tokens: Counter[str] = Counter()
        self.plen: dict[str, int] = {}
        self.window_prompt_tokens: Counter[str] = Counter()  # of requests whose first token came in it
        self.in_flight_s: Counter[str] = Counter()  # ∫ requests in flight dt, per model
        self.late_max = 0.0
        self._tick = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def sent(self, rid: str, model: str, due: float, prompt_len: int = 0) -> None:
        self.model[rid], self.due[rid], self.plen[rid] = model, due, prompt_len
        self.live[model].add(rid)
        self.late_max = max(self.late_max, self.now() - due)

    def tick(self, now: float) -> None:
        for m, live in self.live.items():
            self.in_flight_s[m] += (now - self._tick) * len(live)
        self._tick = now

    def take(self, outs: Iterable[Any], now: float) -> None:
        lo, hi = self.window
        for o in outs:
            m = self.model.get(o.req_id)
            if m is None:
                continue
            n = len(o.new_token_ids)
            if n:
                if o.req_id not in self.first:
                    self.first[o.req_id] = now
                    if lo <= now < hi:
                        self.window_prompt_tokens[m] += self.plen[o.req_id]
                self.last[o.req_id] = now
                self.ntok[o.req_id] += n
                self.tokens[m] += n
                if lo <= now < hi:
                    self.window_tokens[m] += n
            if o.finish_reason is not None:
                self.reason[o.req_id] = o.finish_reason
                self.live[m].discard(o.req_id)

    def latency(self, model: str) -> dict[str, Any]:
        """TTFT (from due) and TPOT (per request with two tokens or more, aborted ones included), ms."""
        rids = [r for r, m in self.model.items() if m == model]
        ttft = [(self.first[r] - self.due[r]) * 1e3 for r in rids if r in self.first]
        tpot = [(self.last[r] - self.first[r]) * 1e3 / (self.ntok[r] - 1) for r in rids if self.ntok[r] > 1]
        return {"ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
                "tpot_ms_p50": pct(tpot, 50), "tpot_ms_p99": pct(tpot, 99)}


class Bench:
    """One engine under the planned budget, the workloads, and the phases."""

    def __init__(self, a: argparse.Namespace, dirs: dict[str, Path], plan: Plan) -> None:
        self.a, self.dirs, self.plan = a, dirs, plan
        buckets = None if a.decode_buckets is None else tuple(a.decode_buckets)
        self.core = EngineCore(EngineOptions(max_num_batched_tokens=a.max_num_batched_tokens, decode_buckets=buckets,
                                             seed=a.seed, warm_tier_bytes=a.warm_tier_bytes,
                                             shared_step_tokens=getattr(a, "shared_step_tokens", None) or 0,
                                             quiet_window_ms=_quiet_window_ms(a)),
                               device=a.device, budget=plan.budget)
        # As the worker does at start (untimed): the tier's RAM pinned once, not at the first unload.
        t = time.perf_counter()
        pinned = self.core.loader.warm_tier is not None and self.core.loader.warm_tier.prepin()
        self.prepin_s = time.perf_counter() - t if pinned else None
        self.rng = random.Random(a.seed)
        self.vocab: dict[str, int] = {}
        self.block: dict[str, int] = {}
        self.calls = 0
        self._n = 0

    # -- models ----------------------------------------------------------------------------
    def load(self, name: str) -> dict[str, Any]:
        kv = self.plan.kv_pages if name in ("A", "B") else None
        t0 = time.perf_counter()
        info = self.core.load_model(LoadSpec(name, self.dirs[name], max_model_len=self.a.max_model_len,
                                             max_num_seqs=self.a.max_num_seqs, num_kv_pages=kv))
        s = time.perf_counter() - t0
        warm = self.core.loader.last_load_timings.get("warm") == 1.0  # restored from the tier, by its own account
        self.vocab[name], self.block[name] = info.vocab_size, info.block_size
        booked = self.core.memory().models.get(name)
        return {"s": s, "from": "warm_tier" if warm else "files", "kv_pages": info.kv_pages,
                "tokens_per_page": info.block_size, "workspace_booked": booked.workspace if booked is not None else None}

    def unload(self, name: str) -> float:
        t0 = time.perf_counter()
        self.core.unload_model(name)
        self.drain()
        return time.perf_counter() - t0

    # -- requests --------------------------------------------------------------------------
    def add(self, model: str, prompt: list[int], max_tokens: int) -> str:
        self._n += 1
        rid = f"{model}-{self._n}"
        self.core.add_request(rid, model, prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                 ignore_eos=True))
        return rid

    def prompt(self, model: str, n: int, rng: random.Random | None = None) -> list[int]:
        r = rng or self.rng
        return [r.randrange(10, self.vocab[model]) for _ in range(n)]

    def step(self, tr: Tracker | None = None, until: float | None = None) -> None:
        """One ``step()`` call; when it left a step yielded (EngineCore.yielded), wait as the worker
        does: until that step is done or, on ``tr``'s clock, the next request is due (``until``)."""
        outs = self.core.step()
        self.calls += 1
        if tr is not None:
            now = tr.now()
            tr.tick(now)
            tr.take(outs, now)
        yielded = self.core.yielded()
        if yielded is not None:
            # The worker sleeps in its selector until a waiter thread sees the event; polling
            # every 0.2 ms here keeps the bench to one thread at a comparable wake-up latency.
            while not yielded.ready() and (until is None or tr is None or tr.now() < until):
                time.sleep(0.0002)

    def drain(self, tr: Tracker | None = None) -> None:
        while self.core.has_unfinished_requests():
            self.step(tr)

    def abort_all(self, tr: Tracker) -> int:
        live = [r for s in tr.live.values() for r in s]
        for rid in live:
            self.core.abort_request(rid)
        self.drain(tr)
        return len(live)

    def sharegpt(self, model: str, n: int, seed: int) -> tuple[list[BenchRequest], int]:
        """``n`` sharegpt-like requests (ops/bench/workload.py) that fit max_model_len; and how many
        drawn did not."""
        draw = n
        while True:  # draw more until n fit (none are dropped at max_model_len >= 2048)
            reqs = sharegpt_like(draw, self.vocab[model], seed)
            fit = [r for r in reqs if r.input_len + r.output_len <= self.a.max_model_len]
            if len(fit) >= n or draw >= 64 * max(n, 1):
                return fit[:n], len(reqs) - len(fit)
            draw *= 2

    def buckets(self) -> list[int]:
        lim = min(self.a.max_num_seqs, self.a.max_num_batched_tokens)
        return sorted(b for b in self.core.pools.decode_buckets if 0 < b <= lim)

    # -- phases ----------------------------------------------------------------------------
    def warm_up(self, models: list[str]) -> dict[str, Any]:
        """Outside every clock: for each decode bucket b, b short requests together (so a decode
        step of exactly b rows runs and its graph is captured if the engine deferred it); then
        ``--warmup-requests`` sharegpt-like requests per model, all models at once (kernels for
        long prefills and mixed steps); then every graph still deferred (mixed-step buckets)."""
        t0 = time.perf_counter()
        for m in models:
            for b in self.buckets():
                for _ in range(b):
                    self.add(m, self.prompt(m, 8), 4)
                self.drain()
        n = 0
        for i, m in enumerate(models):
            reqs, _ = self.sharegpt(m, self.a.warmup_requests, self.a.seed + 100 + i)
            for r in reqs:  # every prompt shape; a few decode steps each (no long tail to wait for)
                self.add(m, r.prompt_token_ids, min(r.output_len, 16))
                n += 1
        self.drain()
        for m in models:  # mixed-step buckets the traffic did not reach: none left to a timed window
            runner = getattr(self.core.slots.find(m), "runner", None)
            if runner is not None and hasattr(runner, "capture_deferred_graphs"):
                runner.capture_deferred_graphs()
        left = {m: c["deferred_graphs"] + c["deferred_mixed_graphs"] for m, c in engine_counters(self.core).items()}
        return {"s": time.perf_counter() - t0, "buckets": self.buckets(), "requests": n,
                "deferred_graphs_after": left}

    def saturated(self, models: list[str], work: dict[str, list[BenchRequest]]) -> dict[str, Any]:
        """``--sat-mode steady``: each model kept at ``--sat-in-flight`` requests of ``work[m]`` (cycled)
        for ``--sat-duration`` s; rates count the tokens returned inside [``--sat-ramp``, duration)
        (prompt tokens of the requests whose first token came back in it). ``offline``: every
        request of ``work[m]`` added at t0 and stepped to the end (engine_bench's mode)."""
        a = self.a
        steady = a.sat_mode == "steady"
        c0, calls0 = engine_counters(self.core), self.calls
        tr = Tracker(window=(a.sat_ramp, a.sat_duration) if steady else (0.0, INF))
        j = dict.fromkeys(models, 0)
        if steady:
            while (now := tr.now()) < a.sat_duration:
                for m in models:
                    while len(tr.live[m]) < a.sat_in_flight:
                        r = work[m][j[m] % len(work[m])]
                        tr.sent(self.add(m, r.prompt_token_ids, r.output_len), m, now, r.input_len)
                        j[m] += 1
                self.step(tr)
        else:
            for m in models:
                for r in work[m]:
                    tr.sent(self.add(m, r.prompt_token_ids, r.output_len), m, 0.0, r.input_len)
            self.drain(tr)
        wall, calls = tr.now(), self.calls - calls0
        engine = counter_delta(c0, engine_counters(self.core), wall)
        aborted = self.abort_all(tr)
        span = a.sat_duration - a.sat_ramp if steady else wall
        per = {}
        for m in models:
            out, tin = tr.window_tokens[m], tr.window_prompt_tokens[m]
            steps = engine["per_model"].get(m, {}).get("steps")
            per[m] = {"requests_added": j[m] if steady else len(work[m]), "output_tokens": out, "prompt_tokens": tin, "output_tok_s": out / span,
                      "total_tok_s": (out + tin) / span,
                      "output_tokens_per_engine_step": tr.tokens[m] / steps if steps else None, **tr.latency(m)}
        out = sum(p["output_tokens"] for p in per.values())
        tot = out + sum(p["prompt_tokens"] for p in per.values())
        return {"seconds": wall, "counted_s": span, "output_tok_s": out / span, "total_tok_s": tot / span,
                "per_model": per, "aborted_at_end": aborted, "step_calls": calls,
                "ms_per_call": wall * 1e3 / calls if calls else None, "engine": engine}

    def arrivals(self, model: str, k: int) -> list[tuple[float, list[int]]]:
        """Model ``k``'s light-load schedule: (due second, prompt), seeded, identical solo and together."""
        a = self.a
        rng = random.Random(a.seed * 1000 + 17 + k)
        out, t, i = [], 0.0, 0
        while True:
            t = t + rng.expovariate(a.light_rate) if a.light_arrivals == "poisson" else (i + 0.5 * k) / a.light_rate
            if t >= a.light_duration:
                return out
            out.append((t, self.prompt(model, a.prompt_len, rng)))
            i += 1

    def light(self, models: list[str], sched: dict[str, list[tuple[float, list[int]]]]) -> dict[str, Any]:
        """Open loop: each model's requests added when due, for ``--light-duration`` seconds; output
        tokens returned inside [ramp, duration) per second is the delivered rate. In-flight requests
        are aborted at the end (their tokens so far count toward TPOT)."""
        a = self.a
        dur, ramp = a.light_duration, a.light_ramp
        c0, calls0 = engine_counters(self.core), self.calls
        tr = Tracker(window=(ramp, dur))
        idx = dict.fromkeys(models, 0)
        while (now := tr.now()) < dur:
            tr.tick(now)  # before the adds: the time up to now had the old requests in flight
            for m in models:
                while idx[m] < len(sched[m]) and sched[m][idx[m]][0] <= now:
                    due, prompt = sched[m][idx[m]]
                    tr.sent(self.add(m, prompt, a.gen_len), m, due)
                    idx[m] += 1
            nxt = min((sched[m][idx[m]][0] for m in models if idx[m] < len(sched[m])), default=dur)
            if self.core.has_unfinished_requests():
                self.step(tr, until=nxt)
            else:
                time.sleep(max(0.0, min(nxt, dur) - now))
        for m in models:  # due before the end, not yet added (the last step ran past it): they arrived
            for due, prompt in sched[m][idx[m]:]:
                tr.sent(self.add(m, prompt, a.gen_len), m, due)
        tr.tick(tr.now())
        wall, calls = tr.now(), self.calls - calls0
        engine = counter_delta(c0, engine_counters(self.core), wall)
        aborted = self.abort_all(tr)
        per = {}
        for m in models:
            rids = [r for r, x in tr.model.items() if x == m]
            per[m] = {"arrived": len(rids), "completed": sum(tr.reason.get(r) == "length" for r in rids),
                      "offered_tok_s": len(rids) * a.gen_len / dur,
                      "delivered_tok_s": tr.window_tokens[m] / (dur - ramp),
                      "mean_in_flight": tr.in_flight_s[m] / wall, **tr.latency(m)}
        return {"seconds": wall, "aborted_at_end": aborted, "late_max_ms": tr.late_max * 1e3, "per_model": per,
                "step_calls": calls, "engine": engine}

    def ttft(self, quiet: str, flood: str | None, flood_n: int, flood_work: list[BenchRequest],
             *, trickle: bool = True) -> dict[str, Any]:
        """``--trickle`` quiet requests (``--prompt-len`` tokens, one output token), one due every
        ``--ttft-interval`` s; with ``flood``, that model is topped up to ``flood_n`` sharegpt-like
        requests in flight the whole time, from ``--ttft-lead`` s before the first quiet one.
        ``trickle=False``: the flood alone for the same time (what the quiet one costs it)."""
        a = self.a
        lead = a.ttft_lead if flood else 0.0
        end = lead + a.trickle * a.ttft_interval
        due = [lead + k * a.ttft_interval for k in range(a.trickle)] if trickle else []
        prompts = [self.prompt(quiet, a.prompt_len) for _ in due]
        c0, calls0 = engine_counters(self.core), self.calls
        tr = Tracker(window=(lead, INF))
        quiet_ids: list[str] = []
        k = j = 0
        timed_out = False
        while k < len(due) or tr.live[quiet] or (not trickle and tr.now() < end):
            now = tr.now()
            if now > end + a.phase_timeout:
                timed_out = True
                break
            tr.tick(now)
            while k < len(due) and due[k] <= now:
                quiet_ids.append(self.add(quiet, prompts[k], 1))
                tr.sent(quiet_ids[-1], quiet, due[k])
                k += 1
            while flood and len(tr.live[flood]) < flood_n:
                r = flood_work[j % len(flood_work)]
                tr.sent(self.add(flood, r.prompt_token_ids, r.output_len), flood, now)
                j += 1
            if self.core.has_unfinished_requests():
                self.step(tr, until=due[k] if k < len(due) else None)
            elif k < len(due):
                time.sleep(max(0.0, due[k] - now))
        wall, calls = tr.now(), self.calls - calls0
        engine = counter_delta(c0, engine_counters(self.core), wall)
        self.abort_all(tr)
        ms = [(tr.first[r] - tr.due[r]) * 1e3 for r in quiet_ids if r in tr.first]
        res: dict[str, Any] = {"ttft_ms": ms, "p50_ms": pct(ms, 50), "p90_ms": pct(ms, 90),
                               "max_ms": max(ms, default=None), "timed_out": timed_out,
                               "step_calls": calls, "engine": engine}
        if flood:
            span = max(wall - lead, 1e-9)
            res["flood"] = {"model": flood, "in_flight": flood_n, "added": j,
                            "output_tok_s": tr.window_tokens[flood] / span,
                            "mean_in_flight": tr.in_flight_s[flood] / wall}
        return res

    def swaps(self) -> dict[str, Any]:
        """A out (into the warm tier when there is one), C in; C out, A in again (from the warm
        tier); then A out and in with the warm tier set aside (its files, from the page cache)."""
        to_small = {"unload_A_s": self.unload("A"), "load_C": self.load("C")}
        back = {"unload_C_s": self.unload("C"), "load_A": self.load("A")}
        back["total_s"] = back["unload_C_s"] + back["load_A"]["s"]
        tier, self.core.loader.warm_tier = self.core.loader.warm_tier, None
        try:
            key = self.core.slots.get("A").warm_key
            unload_s = self.unload("A")
            if tier is not None and key is not None:  # A's copy may not serve this load by any path
                tier.discard(key)
            page = {"unload_A_s": unload_s, "load_A": self.load("A")}
        finally:
            self.core.loader.warm_tier = tier
        page["total_s"] = page["unload_A_s"] + page["load_A"]["s"]
        return {"to_small": to_small, "warm_tier": back, "page_cache": page,
                "warm_tier_bytes": self.a.warm_tier_bytes}


def light_ratios(solo: dict[str, dict[str, Any]], together: dict[str, Any]) -> dict[str, Any]:
    """Per model: together / solo for delivered tok/s, TPOT p50 and TTFT p50."""
    out = {}
    for m, s in solo.items():
        t = together["per_model"][m]
        s = s["per_model"][m]
        out[m] = {"delivered": ratio(t["delivered_tok_s"], s["delivered_tok_s"]),
                  "tpot_p50": ratio(t["tpot_ms_p50"], s["tpot_ms_p50"]),
                  "ttft_p50": ratio(t["ttft_ms_p50"], s["ttft_ms_p50"])}
    return out

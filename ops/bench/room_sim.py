"""Room policy on the CPU: the manager's own code (ModelManager, RoomPlanner) against a simulated
engine, to screen room and drain policies before a GPU run.

The density bench (ops/bench/density_bench.py) is the measure: the daemon on the GPU. A policy
change there costs a device run per variant, and a run per card: the H100 holds four bf16 8Bs,
the H200 seven, and the two regimes answer differently. This replays the same open-loop arrivals
(Poisson, Zipf popularity) through the real manager in real time, with an engine reduced to what
the room decisions see and what they cost the steps: ``slots`` models fit (a load beyond that is
refused at once, naming the least recently used idle models it was offered, as the engine
does); a load takes ``load_s``; one model's batch is stepped at a time (``step_ms``, plus
``seq_us`` a request and ``prefill_ms`` a new one), the least recently stepped model with work
first, a drained (expedited) one ahead of the rest (``--expedite first``, the engine's rule) or
every other step (``share``); each model's status row says its running requests and the tokens
they still have to go. Left out: the device's own contention (a load beside steps, larger
batches' step times), so its figures are the policy's share of a swap, not the swap.

    python -m ops.bench.room_sim --slots 7 --step-ms 4.6 --duration 70 --out sim.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from agent.config import load_settings
from agent.manager.entries import State
from agent.manager.manager import ModelManager
from agent.metrics import Metrics
from agent.worker.client import WorkerError
from engine.model_info import ModelInfo
from ops.bench.density_bench import arrivals, figures, zipf_weights

MODEL_BYTES = 16 << 30  # one bf16 8B, as the refusals name it (the figures only: nothing is allocated)


@dataclass
class SimRequest:
    left: int  # tokens still to produce (the first one included)
    first: asyncio.Future[float]
    done: asyncio.Future[float]
    first_at: float | None = None


class SimEngine:
    """What the manager asks of the worker, answered by a model count and a step loop: each step
    is one model's batch (every running request of it: new ones get their first token, the rest
    one more), ``step_s`` + ``seq_s`` a request + ``prefill_s`` a new one; the model stepped is the
    least recently stepped of those with work, an expedited one first (``expedite``: "first",
    as the engine does, or "share": every other step while others have work)."""

    def __init__(self, slots: int, load_s: float, step_s: float, seq_s: float, prefill_s: float,
                 expedite: str) -> None:
        self.slots, self.load_s, self.step_s, self.seq_s, self.prefill_s = slots, load_s, step_s, seq_s, prefill_s
        self.expedite_mode = expedite
        self.alive = True
        self.loaded: list[str] = []
        self.loading: set[str] = set()
        self.reqs: dict[str, list[SimRequest]] = {}
        self.expedited: set[str] = set()
        self.drained: list[str] = []  # each model expedited, in order: the manager's drains
        self.last_step: dict[str, float] = {}
        self.state = SimpleNamespace(engine_error="", stale_models=set(), memory=None)
        self.loads = 0
        self.steps = 0
        self._wake = asyncio.Event()
        self._last_urgent = False


    def add(self, model: str, gen_len: int) -> SimRequest:
        loop = asyncio.get_running_loop()
        r = SimRequest(gen_len, loop.create_future(), loop.create_future())
        self.reqs[model].append(r)
        self._wake.set()
        return r

    def _pick(self) -> str | None:
        busy = [m for m in self.loaded if self.reqs.get(m)]
        if not busy:
            return None
        self.expedited &= set(busy)
        urgent = [m for m in busy if m in self.expedited]
        rest = [m for m in busy if m not in self.expedited]
        if urgent and not (self.expedite_mode == "share" and self._last_urgent and rest):
            pool = urgent
        else:
            pool = rest or urgent
        self._last_urgent = pool is urgent
        return min(pool, key=lambda m: self.last_step.get(m, 0.0))

    async def run(self) -> None:
        while True:
            m = self._pick()
            if m is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = list(self.reqs[m])
            new = sum(r.first_at is None for r in batch)
            await asyncio.sleep(self.step_s + self.seq_s * len(batch) + self.prefill_s * new)
            now = time.monotonic()
            self.steps += 1
            self.last_step[m] = now
            running = self.reqs.get(m, [])  # (none left when it was unloaded during the step)
            for r in [r for r in batch if r in running]:
                if r.first_at is None:
                    r.first_at = now
                    r.first.set_result(now)
                r.left -= 1
                if r.left <= 0:
                    running.remove(r)
                    r.done.set_result(now)

    async def load(self, spec: Any, evictable: list[str] | None = None) -> Any:
        held = len(self.loaded) + len(self.loading)
        if held >= self.slots:  # refused at once, before any allocation, as the engine does
            short = held - self.slots + 1
            offer = list(evictable or [])
            raise WorkerError("no room", "no_room", {
                "needed": MODEL_BYTES, "free": 0, "budget": self.slots * MODEL_BYTES, "short": short * MODEL_BYTES,
                "evictable": len(offer) * MODEL_BYTES, "evict": offer[:short] if len(offer) >= short else []})
        self.loading.add(spec.name)
        try:
            await asyncio.sleep(self.load_s)
        finally:
            self.loading.discard(spec.name)
        self.loaded.append(spec.name)
        self.reqs.setdefault(spec.name, [])
        self.loads += 1
        return SimpleNamespace(info=ModelInfo(spec.name, 32000, spec.max_model_len or 4096, [2], MODEL_BYTES, 0, 16),
                               timings={"total_s": self.load_s})

    async def unload(self, name: str, timeout: float | None = None) -> None:
        await asyncio.sleep(0.005)
        self.loaded.remove(name)
        self.expedited.discard(name)
        for r in self.reqs.pop(name, []):  # what a drain's deadline left: aborted, as the engine does
            for f in (r.first, r.done):
                if not f.done():
                    f.set_exception(WorkerError("the model was unloaded under the request", "aborted"))

    def tokens_to_go(self) -> dict[str, int]:
        """What the engine's status rows say of each loaded model: its longest request's tokens to go."""
        return {n: max((r.left for r in rs), default=0) for n, rs in self.reqs.items() if n in self.loaded}

    def broken_models(self) -> dict[str, str]:
        return {}

    def expedite(self, name: str, on: bool = True) -> None:
        if on:
            self.expedited.add(name)
            self.drained.append(name)
        else:
            self.expedited.discard(name)

    def preemptible(self, name: str, min_tokens_left: int = 0) -> int:
        return 0

    def preempt(self, name: str) -> int:
        return 0


class SimSource:
    """A model source over folders under ``root``: ``cached`` are there; a pull takes ``pull_s``
    and makes the folder. No bytes, no hashes: what the manager's room decisions read of a
    source, and the tests' stand-in for the disk cache too."""

    def __init__(self, root: Path, cached: list[str], pull_s: float = 0.0) -> None:
        self.root, self.cached, self.pull_s = root, set(cached), pull_s
        for n in cached:
            (root / n).mkdir(parents=True, exist_ok=True)
        self.wanted: list[tuple[str, str]] = []  # derived artifacts asked for (want_derived)

    def snapshot(self, name: str) -> Path | None:
        return self.root / name if name in self.cached else None

    def cached_names(self) -> list[str]:
        return sorted(self.cached)

    def version(self, name: str) -> str | None:
        return "v1" if name in self.cached else None

    async def pull(self, name: str, verify: bool = False) -> Path:
        await asyncio.sleep(self.pull_s)
        (self.root / name).mkdir(parents=True, exist_ok=True)
        self.cached.add(name)
        return self.root / name

    def pull_progress(self, name: str) -> None:
        return None

    async def check(self, name: str, rehash: bool = False) -> list[str]:
        return []

    async def pin(self, name: str) -> None: ...

    def unpin(self, name: str) -> None: ...

    def stats(self) -> dict[str, int]:
        return {}

    def derived(self, name: str, scheme: str) -> Path | None:
        d = self.root / f"{name}.{scheme}"
        return d if d.is_dir() else None

    def want_derived(self, name: str, scheme: str) -> None:
        self.wanted.append((name, scheme))

    def drop_derived(self, name: str, scheme: str) -> None:
        shutil.rmtree(self.root / f"{name}.{scheme}")


async def _request(mgr: ModelManager, eng: SimEngine, name: str, gen_len: int) -> dict:
    sent = time.monotonic()
    ready = mgr.get(name).state is State.READY
    try:
        adm = await mgr.admit_wait(name)
    except Exception as e:  # noqa: BLE001 - a refusal is the request's error, as the API answers it
        return {"model": name, "error": type(e).__name__, "ready_at_send": ready}
    with adm:
        r = eng.add(name, gen_len)
        try:
            first = await r.first
            last = await r.done
        except WorkerError as e:
            return {"model": name, "error": e.code, "ready_at_send": ready}
    return {"model": name, "ttft": first - sent, "tpot": (last - first) / max(gen_len - 1, 1), "ready_at_send": ready,
            "sent_s": sent, "out": gen_len}


async def simulate(a: argparse.Namespace) -> dict:
    names = [f"d{i:02d}" for i in range(a.models)]
    settings = load_settings(models=[{"name": n, "keep_alive": -1} for n in names])
    eng = SimEngine(a.slots, a.load_s, a.step_ms / 1e3, a.seq_us / 1e6, a.prefill_ms / 1e3, a.expedite)
    stepping = asyncio.ensure_future(eng.run())
    drains = eng.drained  # every drain is expedited (preemption is not simulated)
    with tempfile.TemporaryDirectory() as tmp:
        mgr = ModelManager(settings, eng, SimSource(Path(tmp), names), Metrics(), lambda p: object())
        mgr.start()
        for n in names:  # the warm-up: every model loaded once, the last ones resident
            await asyncio.wait_for(mgr.admit_wait(n), 60)
        t0 = time.monotonic()
        loads0, drains0 = eng.loads, len(drains)
        resident = 0
        tasks = []
        rates = [a.rate * w for w in zipf_weights(a.models, a.zipf)]
        for at, m in arrivals(rates, a.duration, a.seed):
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            resident = max(resident, len(eng.loaded))
            tasks.append(asyncio.ensure_future(_request(mgr, eng, names[m], a.gen_len)))
        recs = await asyncio.gather(*tasks)
        await mgr.close()
        stepping.cancel()
    per = {n: figures([r for r in recs if r["model"] == n]) for n in names}
    return {"args": vars(a), "overall": {**figures(list(recs)), "loads": eng.loads - loads0,
                                         "drains": len(drains) - drains0, "max_resident": resident},
            "per_model": {n: {k: v for k, v in f.items() if k in ("requests", "ttft_ms_p50", "slo_ttft_2s")}
                          for n, f in per.items()},
            "drained": {n: drains[drains0:].count(n) for n in names},
            "records": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in recs]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=int, default=12)
    ap.add_argument("--slots", type=int, default=7, help="models that fit at once (H200: 7 bf16 8Bs, H100: 4)")
    ap.add_argument("--rate", type=float, default=4.0, help="requests a second, all models")
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--duration", type=float, default=70.0)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--step-ms", type=float, default=6.0, help="a step of one model's batch, before its requests")
    ap.add_argument("--seq-us", type=float, default=100.0, help="a step's time for each request in its batch")
    ap.add_argument("--prefill-ms", type=float, default=10.0, help="a step's time for each new request's prompt")
    ap.add_argument("--expedite", choices=["first", "share"], default="first",
                    help="a drained model's steps: ahead of every other model's (the engine's), or every other step")
    ap.add_argument("--load-s", type=float, default=0.31, help="an engine load (0.31: from the warm tier)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="JSON here")
    a = ap.parse_args(argv)
    res = asyncio.run(simulate(a))
    o = res["overall"]
    print(json.dumps({k: o.get(k) for k in ("requests", "errors", "ttft_ms_p50", "ttft_ms_p99", "slo_ttft_2s",
                                             "swap_ttft_ms_p50", "swap_ttft_ms_p99", "loads", "drains",
                                             "max_resident")}))
    print("drained:", res["drained"], file=sys.stderr)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

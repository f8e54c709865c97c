"""Two host costs behind the serving path's CPU, measured on this machine (docs/perf.md):

* ``gc``: the share of a worker-like loop spent in Python's cycle collections, with torch imported
  (its objects are what a full collection walks) — each step makes and drops 200 small output
  objects, a packed list per output and a map, as a step's outputs do — with the heap as it is
  and with it frozen first (engine/core/heap.py). Each variant runs in a fresh interpreter.
* ``histogram``: one ``observe`` of a labelled prometheus_client Histogram against the agent's
  LoopHistogram (agent/metrics.py), the inter-token latency's per-token cost.

    python -m ops.bench.host_costs [--steps 3000] [--out JSON]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import subprocess
import sys
import timeit

_GC_LOOP = r"""
import gc, json, sys, time
from dataclasses import dataclass
import torch  # noqa: F401  (its objects are the long-lived heap)
@dataclass
class Out:
    req_id: str
    ids: list
    finish: object
    logprobs: object
    n_prompt: int
    n_cached: int
def step(n=200):
    outs = [Out("req-%d" % i, [i], None, None, 100, 0) for i in range(n)]
    packed = [[o.req_id, list(o.ids), o.finish, o.logprobs, o.n_prompt, o.n_cached] for o in outs]
    return len(packed) + len({o.req_id: o for o in outs})
spent = [0.0, 0]
def cb(phase, info, t=[0.0]):
    if phase == "start":
        t[0] = time.perf_counter()
    else:
        spent[0] += time.perf_counter() - t[0]
        spent[1] += info["generation"] == 2
gc.collect()
if sys.argv[1] == "frozen":
    gc.freeze()
tracked = len(gc.get_objects())
gc.callbacks.append(cb)
t = time.perf_counter()
for _ in range(int(sys.argv[2])):
    step()
wall = time.perf_counter() - t
print(json.dumps({"loop_s": wall, "collections_s": spent[0], "full_collections": spent[1],
                  "share": spent[0] / wall, "tracked_objects": tracked}))
"""


def gc_share(steps: int) -> dict:
    out = {}
    for mode in ("as is", "frozen"):
        r = subprocess.run([sys.executable, "-c", _GC_LOOP, mode, str(steps)], capture_output=True, text=True,
                           check=True, timeout=600)
        out[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def histogram_observe(n: int = 200_000) -> dict:
    from prometheus_client import CollectorRegistry, Histogram

    from agent.metrics import _ITL_BUCKETS, LoopHistogram

    theirs = Histogram("h", "h", ["model"], buckets=_ITL_BUCKETS, registry=CollectorRegistry()).labels(model="m")
    ours = LoopHistogram("h", "h", ["model"], buckets=_ITL_BUCKETS, registry=CollectorRegistry()).labels(model="m")
    return {name: min(timeit.repeat(lambda c=child: c.observe(0.016), number=n, repeat=3)) / n * 1e6
            for name, child in (("prometheus_client_us", theirs), ("loop_histogram_us", ours))}


def main(argv: list[str] | None = None) -> int:
    from ops.bench.engine_bench import _commit, save_result

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--out", help="JSON path (default: docs/perf/<date>-host-costs-<commit>.json)")
    a = ap.parse_args(argv)
    now, commit = dt.datetime.now(dt.timezone.utc), _commit()
    result = {"date": now.isoformat(timespec="seconds"), "commit": commit,
              "command": "python -m ops.bench.host_costs " + shlex.join(argv or sys.argv[1:]),
              "gc": gc_share(a.steps), "histogram": histogram_observe()}
    save_result(result, a.out, f"{now:%Y%m%d-%H%M}-host-costs-{commit}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

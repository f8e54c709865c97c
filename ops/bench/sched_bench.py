"""Host cost of the scheduler alone: ``schedule()`` and ``update()`` per step with N running
decodes (no model, no torch), the part of every step the GPU waits for unless it overlaps; with
and without a prefix index (its cost: a key per block as pages fill, 1 in 16 decode steps of a
sequence at 16 tokens a page), and the admission of N prompts that share a system prompt.

    python -m ops.bench.sched_bench --running 512 --steps 200
"""

from __future__ import annotations

import argparse
import json
import random
import time

from engine.sched.block_manager import BlockManager, PageAllocator
from engine.sampling import SamplingParams
from engine.sched.prefix_index import PrefixIndex
from engine.sched.scheduler import Scheduler, SchedulerConfig


def run(running: int, steps: int, prompt_len: int = 200, seed: int = 0, prefix: bool = False,
        shared: int = 0) -> dict[str, float]:
    """``shared``: the prompts begin with the same ``shared`` tokens (a system prompt)."""
    rng = random.Random(seed)
    s = Scheduler(SchedulerConfig(max_num_seqs=running, max_num_batched_tokens=16384, max_model_len=4096),
                  BlockManager(16, PageAllocator(running * 256), PrefixIndex("bench") if prefix else None))
    params = SamplingParams(max_tokens=100000, temperature=0, ignore_eos=True)
    system = [rng.randrange(1000) for _ in range(shared)]
    for i in range(running):
        s.add(f"r{i}", system + [rng.randrange(1000) for _ in range(prompt_len - shared)], params)
    t0 = time.perf_counter()
    n_admit = 0
    while s.num_waiting or any(len(q.token_ids) == q.num_prompt_tokens for q in s.running):  # prefill
        out = s.schedule()
        n_admit += 1
        s.update(out, [1] * sum(1 for e in out.seqs if e.sample))
    t_prefill = time.perf_counter() - t0
    t_sched = t_upd = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        out = s.schedule()
        t1 = time.perf_counter()
        s.update(out, [1] * len(out.seqs))
        t_sched += t1 - t0
        t_upd += time.perf_counter() - t1
    return {"running": running, "steps": steps, "prefix_caching": prefix, "shared_tokens": shared,
            "schedule_ms": t_sched * 1e3 / steps, "update_ms": t_upd * 1e3 / steps,
            "prefill_schedule_ms_total": t_prefill * 1e3, "prefill_steps": n_admit,
            "cached_tokens": s.blocks.prefix.hit_tokens if prefix else 0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--shared", type=int, default=128, help="system-prompt tokens for the shared-prefix rows")
    a = ap.parse_args(argv)
    for prefix, shared in ((False, 0), (True, 0), (False, a.shared), (True, a.shared)):
        print(json.dumps(run(a.running, a.steps, prefix=prefix, shared=shared)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

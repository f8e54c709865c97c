"""Device trace of decode-only and mixed steps of the 8B model at a serving batch (~200 running).

    . ops/gpu/env.sh; python3 ops/gpu/step_trace.py /tmp/m8b $OUT/trace.txt

Prints, for each kind of step, the wall time per step and torch.profiler's table of device
kernels (eager: every kernel visible), so a slow step kind can be attributed to kernels.
"""

from __future__ import annotations

import os
import random
import sys
import time


import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from engine.core.engine_core import EngineCore  # noqa: E402
from engine.options import EngineOptions  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.load_spec import LoadSpec  # noqa: E402


def _attention_alone(slot, batch: int, ctx: int, chunk: int) -> str:
    """One layer's attention kernel alone: decode rows by the decode kernel, the same rows by the
    prefill kernel (the mixed route), and decode rows plus one prompt chunk (ms per call)."""
    from engine.kernels.attention_triton import paged_attention_triton

    kv, cfg = slot.kv, slot.config
    kc, vc = kv.k(0), kv.v(0)
    bs = kc.shape[1]
    pages_per = -(-(ctx + chunk + 1) // bs)
    dev = kc.device

    def case(qlens):
        b = len(qlens)
        lens = torch.tensor([ctx + q for q in qlens], dtype=torch.int32, device=dev)
        qsl = torch.zeros(b + 1, dtype=torch.int32, device=dev)
        qsl[1:] = torch.cumsum(torch.tensor(qlens, device=dev), 0)
        bt = (torch.arange(b * pages_per, device=dev, dtype=torch.int32) % kc.shape[0]).view(b, pages_per)
        q = torch.randn(sum(qlens), cfg.num_heads, cfg.head_dim, dtype=kc.dtype, device=dev)
        return q, qsl, lens, bt, max(qlens), int(lens.max())

    out = []
    for name, qlens, force_prefill in (("decode kernel, %d rows" % batch, [1] * batch, False),
                                       ("prefill kernel, %d one-token rows" % batch, [1] * batch, True),
                                       ("prefill kernel, %d rows + %d chunk" % (batch, chunk), [1] * batch + [chunk], True)):
        q, qsl, lens, bt, mq, ms = case(qlens)
        mq = max(mq, 2) if force_prefill else mq
        for _ in range(3):
            paged_attention_triton(q, kc, vc, qsl, lens, bt, 0.1, mq, ms)
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(20):
            paged_attention_triton(q, kc, vc, qsl, lens, bt, 0.1, mq, ms)
        e1.record()
        torch.cuda.synchronize()
        out.append(f"attention alone: {name}: {e0.elapsed_time(e1) / 20:.3f} ms per layer call")
    return "\n".join(out)


def main() -> int:
    model_dir, out_path = sys.argv[1], sys.argv[2]
    batch = int(os.environ.get("TRACE_BATCH", "200"))
    ctx = int(os.environ.get("TRACE_CTX", "300"))
    chunk = int(os.environ.get("TRACE_CHUNK", "216"))
    core = EngineCore(EngineOptions(max_num_batched_tokens=4096, seed=0, cuda_graphs=False),
                      device="cuda")  # eager: every kernel in the trace
    core.load_model(LoadSpec("m", model_dir, max_model_len=4096, max_num_seqs=256))
    rng = random.Random(0)
    p = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)
    for i in range(batch):
        core.add_request(f"r{i}", "m", [rng.randrange(100, 100000) for _ in range(ctx)], p)
    slot = core.slots.get("m")
    while slot.scheduler.num_waiting or any(not s.is_decoding for s in slot.scheduler.running):
        core.step()
    for _ in range(3):
        core.step()
    lines = []
    new = 0

    def run(kind: str, n: int) -> None:
        nonlocal new
        torch.cuda.synchronize()
        times = []
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                if kind != "decode":
                    core.add_request(f"n{new}", "m", [rng.randrange(100, 100000) for _ in range(chunk)], p)
                    new += 1
                t = time.perf_counter()
                core.step()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t) * 1e3)
        lines.append(f"== {kind}: {n} steps, wall ms per step {[round(x, 2) for x in times]}")
        try:
            lines.append(prof.key_averages().table(sort_by="device_time_total", row_limit=18, max_name_column_width=70))
        except Exception:  # older spelling
            lines.append(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))

    run("decode", 5)
    run("mixed", 5)
    lines.append(_attention_alone(slot, batch, ctx, chunk))
    text = "\n".join(lines)
    print(text)
    with open(out_path, "w") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a decode graph's time goes, by batch size, bf16 beside FP8: each bucket's captured decode
graph replayed on a filled batch (every row ``ctx`` tokens of context on its own pages), its wall
time per replay, the sum of its kernels' device times (the rest is launch gaps) and the kernels
grouped by kind.

    . ops/gpu/env.sh; python3 ops/gpu/decode_profile.py /tmp/m8b $OUT/decode_profile.json [ctx]
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from engine.core.engine_core import EngineCore
from engine.options import EngineOptions
from engine.load_spec import LoadSpec
from ops.bench.engine_bench import _commit, _release_device

BUCKETS = (1, 8, 32, 64, 128, 256, 512)


def _kind(name: str) -> str:
    for pat, kind in ((r"_small_m_kernel", "fp8 gemm (triton)"), (r"gemm|sm90_xmma|cutlass|nvjet|Kernel2", "gemm (cublas)"),
                      (r"_decode_kernel", "attention decode"), (r"_reduce_kernel", "attention reduce"),
                      (r"_rms_norm", "norm"), (r"_rope", "rope"), (r"_kv_write", "kv write"),
                      (r"_silu", "silu-mul"), (r"_quantize_rows", "quantize rows"), (r"argmax|reduce_kernel|Reduce", "argmax"),
                      (r"elementwise|copy|vectorized", "elementwise/copy"), (r"index|embedding", "embedding")):
        if re.search(pat, name):
            return kind
    return name[:60]


def _fill(bufs, b: int, ctx: int) -> None:
    pages = -(-ctx // 16)
    dev = bufs.device
    rows = torch.arange(b, device=dev, dtype=torch.int32)
    bufs.input_ids[:b].copy_((rows * 7919 + 100) % 30000)
    bufs.positions[:b].fill_(ctx - 1)
    bufs.qsl[:b + 1].copy_(torch.arange(b + 1, dtype=torch.int32, device=dev))
    bufs.seq_lens[:b].fill_(ctx)
    bt = rows[:, None] * pages + torch.arange(pages, device=dev, dtype=torch.int32)[None, :]
    bufs.block_tables[:b].zero_()
    bufs.block_tables[:b, :pages].copy_(bt)
    bufs.slots[:b].copy_((bt[:, -1] * 16 + (ctx - 1) % 16).to(bufs.slots.dtype))


def main() -> int:
    model, out = sys.argv[1], sys.argv[2]
    ctx = int(sys.argv[3]) if len(sys.argv) > 3 else 400
    res: dict = {"commit": _commit(), "ctx": ctx, "runs": {}}
    for q in (None, "fp8"):
        core = EngineCore(EngineOptions(max_num_batched_tokens=16384, block_size=16, seed=0), device="cuda")
        core.load_model(LoadSpec("m", model, max_model_len=2048, max_num_seqs=512, quantization=q))
        runner = core.slots.get("m").runner
        runner.capture_deferred_graphs()
        graphs = runner.graphs
        rows = {}
        for b in BUCKETS:
            if b not in graphs.graphs:
                continue
            _fill(graphs.bufs, b, ctx)
            g = graphs.graphs[b].graph
            wall = do_bench(g.replay, warmup=5, rep=30)  # median ms per replay
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    g.replay()
                torch.cuda.synchronize()
            kinds: dict[str, float] = defaultdict(float)
            count = 0
            for ev in prof.key_averages():
                t = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
                if t and ev.count:
                    kinds[_kind(ev.key)] += t / 5 / 1e3
                    count += ev.count / 5
            busy = sum(kinds.values())
            rows[b] = {"ms_per_replay": wall, "kernel_ms": busy, "gap_ms": wall - busy, "kernels": count,
                       "by_kind_ms": dict(sorted(kinds.items(), key=lambda kv: -kv[1]))}
            print(q or "bf16", b, json.dumps(rows[b]), flush=True)
        res["runs"][q or "bf16"] = rows
        core.unload_model("m")
        del core, runner, graphs
        _release_device("cuda")
    with open(out, "w") as f:
        json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

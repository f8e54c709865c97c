"""Where an unloaded model's device memory goes: the allocator's segments and the live CUDA
tensors after a load, an unload, a reload and a second unload, with graphs off and on.

    . ops/gpu/env.sh; python3 ops/gpu/memory_probe.py [model_dir]

Prints the twelve largest segments (type, MiB, MiB allocated, address) and the live tensors over
1 MiB at each point: what tests/gpu/test_memory_gpu.py asserts, shown instead of asserted.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.core.engine_core import EngineCore  # noqa: E402
from engine.options import EngineOptions  # noqa: E402
from modelgen.make import make_model  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.load_spec import LoadSpec  # noqa: E402

MiB = 1 << 20


def segments(tag: str) -> None:
    torch.cuda.synchronize()
    segs = [(s["segment_type"], s["total_size"] // MiB, s["allocated_size"] // MiB, hex(s["address"]))
            for s in torch.cuda.memory_snapshot() if s["device"] == torch.cuda.current_device()]
    print(f"{tag}: allocated {torch.cuda.memory_allocated() / MiB:.1f} MiB, reserved "
          f"{torch.cuda.memory_reserved() / MiB:.1f} MiB; segments {sorted(segs, key=lambda x: -x[1])[:12]}", flush=True)


def live_tensors(tag: str) -> None:
    gc.collect()
    found = [(tuple(o.shape), str(o.dtype), o.numel() * o.element_size() // MiB)
             for o in gc.get_objects() if torch.is_tensor(o) and o.is_cuda and o.numel() * o.element_size() > MiB]
    print(f"{tag}: live tensors over 1 MiB {sorted(found, key=lambda t: -t[2])[:12]}", flush=True)


def serve(core: EngineCore) -> None:
    core.add_request("r", "m", list(range(10, 40)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while core.has_unfinished_requests():
        core.step()


def main(argv: list[str]) -> int:
    model = Path(argv[0]) if argv else make_model(Path("/tmp/memory-probe/small"), "llama", "small", seed=0)
    for graphs in (False, True):
        print(f"=== CUDA graphs {int(graphs)}")
        segments("start")
        core = EngineCore(EngineOptions(dtype="bfloat16", max_num_batched_tokens=512, seed=0,
                                        decode_buckets=(1, 2, 4), cuda_graphs=graphs), device="cuda", budget=2 << 30)
        core.load_model(LoadSpec("m", model, max_model_len=2048, max_num_seqs=256))
        print("pool MiB", core.pools.pool.num_pages * core.pools.pool.page_bytes // MiB, "ledger", core.pools.ledger.snapshot())
        serve(core)
        segments("loaded")
        core.unload_model("m")
        segments("unloaded")
        live_tensors("unloaded")
        core.load_model(LoadSpec("m", model, max_model_len=2048, max_num_seqs=256))
        serve(core)
        segments("reloaded")
        core.unload_model("m")
        segments("unloaded again")
        live_tensors("unloaded again")
        del core
        gc.collect()
        segments("core dropped")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

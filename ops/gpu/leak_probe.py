"""Which device allocation a load/unload cycle leaves live, with its stack (not run yet).

tests/gpu/test_memory_gpu.py at 57c7cf5 on an H100: the fresh load/unload cycle after a vacancy's
left exactly 32 MiB live that no Python object held (a cuBLAS workspace of a lent stream in a new
role, by inference). This replays the test's sequence with the allocator's history on and writes
every new live block of 1 MiB or more, with its frames, to the JSON file named:
    . ops/gpu/env.sh; python3 ops/gpu/leak_probe.py $OUT/leak.json
"""
import gc, json, sys, torch
from modelgen.make import make_model
from engine.core.engine_core import EngineCore
from engine.options import EngineOptions
from engine.load_spec import LoadSpec
from engine.sampling import SamplingParams
out = sys.argv[1] if len(sys.argv) > 1 else "leak.json"
d = make_model(__import__("pathlib").Path("/tmp/lp") / "small", "llama", "small", seed=0)
x = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16); (x @ x).sum().item(); del x; gc.collect()
def live(tag):
    torch.cuda.synchronize(); print(tag, torch.cuda.memory_allocated() >> 20, "MiB live", flush=True)
def serve(core):
    core.add_request("r", "m", list(range(10, 40)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while core.has_unfinished_requests(): core.step()
torch.cuda.memory._record_memory_history(max_entries=200000)
core = EngineCore(EngineOptions(dtype="bfloat16", max_num_batched_tokens=512, seed=0, decode_buckets=(1, 2, 4), cuda_graphs=True), device="cuda", budget=2 << 30)
spec = LoadSpec("m", d, max_model_len=2048, max_num_seqs=256)
live("start")
core.load_model(spec); serve(core); live("loaded+served")
core.unload_model("m"); live("vacated")
core.load_model(spec); serve(core); live("vacancy reload+served")
core.unload_model("m"); core.pools.grow_when_quiet(0); live("dropped 1")
before = {(b["address"]) for s in torch.cuda.memory_snapshot() for b in s["blocks"] if b["state"] == "active_allocated"}
core.load_model(spec); serve(core); live("fresh load+served")
core.unload_model("m"); live("vacated 2")
core.pools.grow_when_quiet(0); live("dropped 2")
snap = torch.cuda.memory._snapshot()
new = []
for s in snap["segments"]:
    for b in s["blocks"]:
        if b["state"] == "active_allocated" and b["address"] not in before and b["size"] >= 1 << 20:
            new.append({"size": b["size"], "stream": s.get("stream"), "pool": s.get("segment_pool_id"),
                        "frames": [f"{f['filename']}:{f['line']}:{f['name']}" for f in (b.get("frames") or [])][:40]})
json.dump(new, open(out, "w"), indent=1)
for n in new: print(n["size"] >> 20, "MiB", n["stream"], n["pool"], "\n  " + "\n  ".join(f for f in n["frames"] if "site-packages/torch" not in f)[:3000])

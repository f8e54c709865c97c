"""What holds a model's slot on the device, and what the virtual-memory KV range can do (issue 35:
how many 8Bs one budget holds, and why not one more).

    . ops/gpu/env.sh; python3 -m ops.gpu.room_probe --model-dir /tmp/m8b --out $OUT/room_probe.json

Part ``vmm``: a :class:`engine.kv.vmm.VirtualRange` of 8 GiB reserved: mapped and unmapped in
256 MiB chunks, the driver's figure after each change, a CUDA graph captured on the range's
first chunk replayed after the chunks behind it were unmapped, and the seconds a 16 GiB grow and
shrink take. Part ``room``: one EngineCore (budget 0.9), the same 8B under names n0, n1, ... at
the density bench's shape (``max_model_len`` 400, ``max_num_seqs`` 64) loaded until the ledger
refuses; after each load every model's booked weights, workspace (and the measurement it came
from), KV minimum, the pool, and the allocator's segments by (stream, pool); then 16 requests
over the loaded models stepped together, the driver's peak against the ledger.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from ops.gpu.warm_probe import segments

GIB = 1 << 30
MIB = 1 << 20


def driver_used() -> int:
    torch.cuda.synchronize()
    f, t = torch.cuda.mem_get_info()
    return t - f


def probe_vmm() -> dict:
    from engine.kv.vmm import VirtualRange

    out: dict = {}
    base = driver_used()
    r = VirtualRange(torch.device("cuda"), 8 * GIB, 256 * MIB)
    out.update(granularity=r.granularity, chunk=r.chunk, reserved=r.reserved,
               reserve_delta_mib=(driver_used() - base) / MIB)
    r.map_to(512 * MIB)
    t = r.tensor()
    out["same_address"] = t.data_ptr() == r.base
    out["mapped_512_delta_mib"] = (driver_used() - base) / MIB
    out["zeroed"] = bool((t[:512 * MIB] == 0).all().item())
    t[:4096].fill_(1)
    t[256 * MIB:256 * MIB + 4096].fill_(7)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g.capture_begin()
        t[:4096].add_(1)
        g.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    out["replay_before"] = int(t[0].item())
    r.map_to(256 * MIB)
    out["unmapped_to_256_delta_mib"] = (driver_used() - base) / MIB
    g.replay()
    g.replay()
    out["replay_after_unmap"] = int(t[0].item())
    r.map_to(512 * MIB)
    out["remapped_chunk_zero"] = int(t[256 * MIB].item())
    ts = time.perf_counter()
    r.map_to(8 * GIB)
    torch.cuda.synchronize()
    out["grow_8gib_s"] = round(time.perf_counter() - ts, 4)
    out["mapped_8gib_delta_mib"] = (driver_used() - base) / MIB
    ts = time.perf_counter()
    r.map_to(256 * MIB)
    out["shrink_to_256mib_s"] = round(time.perf_counter() - ts, 4)
    out["after_shrink_delta_mib"] = (driver_used() - base) / MIB
    ts = time.perf_counter()
    r.map_to(512 * MIB)
    torch.cuda.synchronize()
    out["grow_one_chunk_s"] = round(time.perf_counter() - ts, 5)
    del g, t
    r.close()
    out["closed_delta_mib"] = (driver_used() - base) / MIB
    for chunk_mib in (2, 64):  # the mapping unit: driver calls against rounding
        r = VirtualRange(torch.device("cuda"), 16 * GIB, chunk_mib * MIB)
        ts = time.perf_counter()
        r.map_to(16 * GIB)
        torch.cuda.synchronize()
        out[f"chunk{chunk_mib}_grow_16gib_s"] = round(time.perf_counter() - ts, 4)
        ts = time.perf_counter()
        r.map_to(1 * GIB)
        out[f"chunk{chunk_mib}_shrink_15gib_s"] = round(time.perf_counter() - ts, 4)
        r.close()
    return out


def probe_room(model_dir: str, max_models: int) -> dict:
    from engine.core.engine_core import EngineCore
    from engine.core.ledger import LoadRefused
    from engine.core.pool_keeper import PoolKeeper
    from engine.load_spec import LoadSpec
    from engine.options import EngineOptions
    from engine.sampling import SamplingParams

    peaks: list[int] = []
    orig_peak = PoolKeeper.device_peak

    def device_peak(self):  # the warm-up's peak, as the loader measures it
        v = orig_peak(self)
        peaks.append(v)
        return v

    PoolKeeper.device_peak = device_peak
    free, total = torch.cuda.mem_get_info()
    core = EngineCore(EngineOptions(dtype="bfloat16", seed=0), device="cuda", budget=int(total * 0.9))
    rows = []
    refusal = None
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    for i in range(max_models):
        name = f"n{i}"
        torch.cuda.empty_cache()
        alloc_before, reserved_before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        ts = time.perf_counter()
        try:
            core.load_model(LoadSpec(name, model_dir, max_model_len=400, max_num_seqs=64))
        except LoadRefused as e:
            refusal = str(e)
            break
        load_s = time.perf_counter() - ts
        m = core.memory()
        mm = m.models[name]
        torch.cuda.empty_cache()
        # what stays after the load (weights, graph pools whole, live buffers) and what only its
        # largest step needs on top (the share a step's activations take while it runs)
        held = torch.cuda.memory_reserved() - reserved_before - mm.weights
        rows.append({
            "held_beside_weights_gib": round(held / GIB, 3),
            "step_transient_gib": round((peaks[-1] - torch.cuda.memory_allocated()) / GIB, 3) if peaks else None,
            "model": name, "load_s": round(load_s, 3), "weights_gib": round(mm.weights / GIB, 3),
            "workspace_gib": round(mm.workspace / GIB, 3), "step_gib": round(m.step / GIB, 3),
            "kv_min_mib": round(mm.kv_min / MIB, 1),
            "measured_peak_delta_gib": round((peaks[-1] - alloc_before) / GIB, 3) if peaks else None,
            "allocated_delta_gib": round((torch.cuda.memory_allocated() - alloc_before) / GIB, 3),
            "ledger_used_gib": round(m.used / GIB, 3), "ledger_free_gib": round(m.free / GIB, 3),
            "kv_pool_gib": round(m.kv / GIB, 3), "pages": m.kv_pages, "untracked_gib": round(m.untracked / GIB, 3),
            "driver_gib": round(driver_used() / GIB, 3), "timings": core.loader.last_load_timings,
            "segments": segments()})
        print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("segments", "timings")}), flush=True)
    names = list(core.models())
    peak = 0
    rid = 0
    for n in names * 2:
        rid += 1
        core.add_request(f"r{rid}", n, [11 + (rid % 50)] * 256, params)
    ts = time.perf_counter()
    steps = 0
    while core.has_unfinished_requests():
        core.step()
        steps += 1
        if steps % 16 == 0:
            peak = max(peak, driver_used())
    traffic = {"requests": rid, "steps": steps, "seconds": round(time.perf_counter() - ts, 2),
               "driver_peak_gib": round(peak / GIB, 3), "ledger_used_gib": round(core.memory().used / GIB, 3),
               "segments_after": segments()}
    print(json.dumps({k: v for k, v in traffic.items() if k != "segments_after"}), flush=True)
    return {"budget_gib": round(int(total * 0.9) / GIB, 3), "total_gib": round(total / GIB, 3),
            "loads": rows, "refusal": refusal, "traffic": traffic}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-models", type=int, default=10)
    ap.add_argument("--parts", default="vmm,room")
    a = ap.parse_args()
    from ops.bench.engine_bench import _commit

    result: dict = {"commit": _commit(), "gpu": torch.cuda.get_device_name()}
    try:
        if "vmm" in a.parts:
            try:
                result["vmm"] = probe_vmm()
            except Exception as e:  # noqa: BLE001 - a probe reports what failed and goes on
                result["vmm"] = {"error": f"{type(e).__name__}: {e}"}
            print(json.dumps(result["vmm"]), flush=True)
        if "room" in a.parts:
            result["room"] = probe_room(a.model_dir, a.max_models)
    finally:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

"""FP8 on an 8B (random Llama-3.1-8B-shaped weights, ``make-model --preset 8b``) on the GPU:

1. logits: the model loaded twice in one engine, bf16 and FP8; prefill logits at every position
   of a few prompts, cosine FP8 vs bf16 per position (issue 19: >= 0.99 at every one);
2. room: under a 42 GiB budget, three FP8 copies load and each serves a few requests; bf16 copies
   under the same budget until one is refused;
3. load: seconds to load bf16 and FP8 (the FP8 quantizes on the copy streams), weight bytes.

    python ops/gpu/fp8_check.py MODEL_DIR [out.json]
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from engine.core.engine_core import EngineCore  # noqa: E402
from engine.options import EngineOptions  # noqa: E402
from engine.core.ledger import LoadRefused  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.load_spec import LoadSpec  # noqa: E402
from ops.bench.fp8_accuracy import prefill_logits  # noqa: E402

GIB = 1 << 30


def serve(core: EngineCore, names: list[str]) -> dict[str, int]:
    got = {n: 0 for n in names}
    for n in names:
        for j in range(4):
            core.add_request(f"{n}-{j}", n, list(range(10 + j, 200 + j)),
                             SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    while core.has_unfinished_requests():
        for o in core.step():
            got[o.req_id.rsplit("-", 1)[0]] += len(o.new_token_ids)
    return got


def main() -> int:
    model_dir = sys.argv[1]
    out = Path(sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.environ.get("OUT", "."), "fp8_check.json"))
    res: dict = {"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("INFIRE_COMMIT", ""),
                 "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model_dir": model_dir}
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128000, (n,), generator=g).tolist() for n in (17, 200, 513, 1024)]
    loads, logits = {}, {}
    for name, q, dtype in (("bf16", None, None), ("fp8", "fp8", None), ("fp32", None, "float32")):
        # no graphs: only prefill logits are read here (and float32 is a test path, not captured)
        core = EngineCore(EngineOptions(max_num_batched_tokens=4096, seed=0, dtype=dtype, cuda_graphs=False),
                          device="cuda")
        t = time.perf_counter()
        info = core.load_model(LoadSpec(name, model_dir, max_model_len=2048, max_num_seqs=8, quantization=q))
        loads[name] = {"load_s": time.perf_counter() - t, "weight_bytes": core.slots.get(name).weight_bytes,
                       "weight_gib": core.slots.get(name).weight_bytes / GIB, "device_bytes": info.device_bytes}
        logits[name] = prefill_logits(core, name, prompts)
        if name == "fp8":
            # the same quantized model through the torch references (engine.kernels.fp8 and the rest):
            # what the scheme computes, against what the Triton/cuBLASLt kernels compute
            from engine.kernels import _dispatch

            _dispatch._forced = "torch"
            try:
                logits["fp8 reference kernels"] = prefill_logits(core, name, prompts)
            finally:
                _dispatch._forced = None
        del core
        torch.cuda.empty_cache()
    res["load"] = loads

    def compare(a: str, b: str) -> dict:
        cos = torch.nn.functional.cosine_similarity(logits[a], logits[b], dim=-1)
        top1 = (logits[a].argmax(-1) == logits[b].argmax(-1)).float().mean().item()
        row = {"positions": int(cos.numel()), "cosine_min": cos.min().item(), "cosine_mean": cos.mean().item(),
               "top1_agreement": top1}
        print(f"logits {a} vs {b}: {row}", flush=True)
        return row

    res["logits"] = compare("fp8", "bf16")
    res["logits_more"] = {f"{a} vs {b}": compare(a, b) for a, b in (
        ("bf16", "fp32"), ("fp8", "fp32"), ("fp8", "fp8 reference kernels"), ("fp8 reference kernels", "fp32"))}
    print(f"load: {json.dumps(loads)}", flush=True)
    del logits

    room = {}
    for kind, q in (("fp8", "fp8"), ("bf16", None)):
        core = EngineCore(EngineOptions(max_num_batched_tokens=4096, seed=0), device="cuda", budget=42 * GIB)
        names, refused = [], None
        for i in range(4):
            try:
                core.load_model(LoadSpec(f"{kind}{i}", model_dir, max_model_len=4096, max_num_seqs=64, quantization=q))
                names.append(f"{kind}{i}")
            except LoadRefused as e:
                refused = str(e)[:300]
                break
        served = serve(core, names)
        mem = core.memory()
        room[kind] = {"loaded": len(names), "refused": refused, "served_tokens": served,
                      "used_gib": mem.used / GIB, "weights_gib": mem.weights / GIB,
                      "budget_gib": mem.budget / GIB}
        print(f"room {kind}: {room[kind]}", flush=True)
        del core
        torch.cuda.empty_cache()
    res["room_42gib"] = room
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

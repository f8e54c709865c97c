"""The transformers peer: ``generate_batch`` (continuous batching, paged attention) on the same requests.

    python -m ops.bench.peer_hf --model-dir DIR [--num-requests 200] [--seed 0]

Takes the first N requests of the sharegpt-like workload (``ops/bench/workload.py``, the same prompts as
engine_bench). ``generate_batch`` takes one ``max_new_tokens`` for the whole batch, so every
request asks for the workload's mean output length (rounded) with eos ignored where the version
allows; tokens are counted from what came back. Prints one JSON line last (the keys of docs/perf.md;
TTFT/TPOT are null: the call returns only at the end).
"""

from __future__ import annotations

import argparse
import json
import time

from ops.bench.workload import sharegpt_like


def run_peer(model_dir: str, num_requests: int, seed: int = 0, device: str = "cuda") -> dict:
    import torch
    import transformers
    from transformers import GenerationConfig

    model = None
    for attn in ("sdpa_paged", "paged|sdpa", None):
        try:
            kw = {"attn_implementation": attn} if attn else {}
            model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, **kw)
            break
        except (ValueError, ImportError, KeyError, TypeError):
            continue
    if model is None:
        raise SystemExit("transformers could not load the model")
    model = model.to(device).eval()
    vocab = model.config.vocab_size
    reqs = sharegpt_like(1000, vocab, seed)[:num_requests]
    max_new = round(sum(r.output_len for r in reqs) / len(reqs))
    cfg = GenerationConfig(max_new_tokens=max_new, do_sample=False, pad_token_id=0, eos_token_id=None)
    inputs = [list(r.prompt_token_ids) for r in reqs]
    # warm-up on a few requests (compiles, allocations), outside the clock
    model.generate_batch(inputs=inputs[:4], generation_config=GenerationConfig(
        max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    outs = model.generate_batch(inputs=inputs, generation_config=cfg)
    sync()
    wall = time.perf_counter() - t0
    gen = 0
    for o in outs.values():
        toks = getattr(o, "generated_tokens", None)
        gen += len(toks) if toks is not None else max_new
    total_in = sum(r.input_len for r in reqs)
    return {"name": f"transformers {transformers.__version__} generate_batch", "requests": len(reqs),
            "max_new_tokens": max_new, "req_s": len(reqs) / wall, "output_tok_s": gen / wall,
            "total_tok_s": (gen + total_in) / wall, "ttft_ms_p50": None, "ttft_ms_p99": None,
            "tpot_ms_p50": None, "tpot_ms_p99": None, "wall_s": wall, "output_tokens": gen,
            "input_tokens": total_in}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="transformers generate_batch peer")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)
    print(json.dumps(run_peer(a.model_dir, a.num_requests, a.seed, a.device)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

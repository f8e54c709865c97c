"""Tensor parallelism on one host: TP=N against TP=1 on the sharegpt-like workload, and batch-1 latency.

Each TP degree runs in its own subprocess (so they never share GPU memory): rank 0 is that
subprocess (a :class:`engine.parallel.engine.TPEngineCore` on ``cuda:0``), ranks 1.. are
follower processes on ``cuda:1``.. (:func:`engine.parallel.follower.spawn_followers`); TP=1 is the
plain :class:`engine.core.engine_core.EngineCore`. Every request is added at t0 (offline mode, as
ops/bench/engine_bench.py), then one request alone times decode per token (128-token prompt,
256 tokens). A short greedy run of 8 prompts is kept per degree to report how many sequences
match TP=1 token for token (bf16 sums in another order can flip a near-tie, so it is a figure,
not an assertion; the fp32 equality test is tests/integration/test_tensor_parallel.py).
NCCL_NVLS_ENABLE=0 is set for every process.

    python3 ops/gpu/tp_bench.py --model-dir /tmp/m8b --tp 1,2 --num-requests 1000 --out $OUT/tp_bench.json
    python3 ops/gpu/tp_bench.py --arch qwen3 --preset tiny --dtype float32 --expect-match --num-requests 50
        (NCCL + decode graphs with collectives on a tiny fp32 model: greedy tokens must equal TP=1's)
    python ops/gpu/tp_bench.py --arch llama --preset tiny --device cpu --num-requests 20   (CPU smoke, gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ["NCCL_NVLS_ENABLE"] = "0"

from ops.bench.workload import TokenTimes, percentile  # noqa: E402
from engine.load_spec import LoadSpec  # noqa: E402


def _drain(core) -> None:
    while core.has_unfinished_requests():
        core.step()


def _workload(core, reqs) -> dict:
    from engine.sampling import SamplingParams

    times = TokenTimes()
    t0 = time.perf_counter()
    for i, r in enumerate(reqs):
        times.sent[f"r{i}"] = time.perf_counter()
        core.add_request(f"r{i}", "bench", r.prompt_token_ids,
                         SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True))
    steps = 0
    while core.has_unfinished_requests():
        outs = core.step()
        times.observe(outs, time.perf_counter())
        steps += 1
    wall = time.perf_counter() - t0
    total_out = times.output_tokens
    total_in = sum(r.input_len for r in reqs)
    return {"requests": len(reqs), "wall_s": wall, "steps": steps, "req_s": len(reqs) / wall,
            "output_tok_s": total_out / wall, "total_tok_s": (total_out + total_in) / wall, **times.latency()}


def _batch1(core, vocab: int, max_tokens: int = 256) -> dict:
    from engine.sampling import SamplingParams

    prompt = [100 + (i * 7919) % (vocab - 200) for i in range(128)]
    core.add_request("b1", "bench", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    times = []
    while core.has_unfinished_requests():
        t = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t)
    dec = times[1:]
    return {"prefill_ms": times[0] * 1e3, "decode_ms_per_token_p50": (percentile(dec, 50) or 0) * 1e3,
            "decode_ms_per_token_p90": (percentile(dec, 90) or 0) * 1e3, "tokens": len(times)}


def _greedy_probe(core, vocab: int) -> list[list[int]]:
    from engine.sampling import SamplingParams

    out: dict[str, list[int]] = {}
    for i in range(8):
        prompt = [100 + (i * 31 + j * 7919) % (vocab - 200) for j in range(16 + 24 * i)]
        core.add_request(f"g{i}", "bench", prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    while core.has_unfinished_requests():
        for o in core.step():
            out.setdefault(o.req_id, []).extend(o.new_token_ids)
    return [out[f"g{i}"] for i in range(8)]


def run_one(a: argparse.Namespace) -> dict:
    """One TP degree in this process (rank 0), followers spawned for TP > 1."""
    import torch

    from engine.core.engine_core import EngineCore
    from engine.options import EngineOptions
    from engine.runner.cuda_graphs import DEFAULT_BUCKETS
    from ops.bench.workload import sharegpt_like, summary

    tp = a.one
    cuda = a.device == "cuda"
    buckets = DEFAULT_BUCKETS if cuda else ()
    opts = {"max_num_batched_tokens": a.max_num_batched_tokens, "block_size": a.block_size, "seed": 0,
            "decode_buckets": buckets, "dtype": a.dtype}
    procs = []
    group = None
    t_load = time.perf_counter()
    if tp == 1:
        core = EngineCore(EngineOptions(**opts), device="cuda:0" if cuda else "cpu")
    else:
        from engine.parallel.engine import TPEngineCore
        from engine.parallel.follower import spawn_followers
        from engine.parallel.group import init_tp_group

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init = f"tcp://127.0.0.1:{port}"
        devices = [f"cuda:{r}" for r in range(tp)] if cuda else ["cpu"] * tp
        env = None
        if not cuda:  # CPU ranks share the cores: one rank's threads spinning starve the others
            threads = max(1, (os.cpu_count() or 1) // tp)
            torch.set_num_threads(threads)
            env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        procs = spawn_followers(tp, init, devices, env=env)
        group = init_tp_group(0, tp, init, devices[0])
        core = TPEngineCore(group, EngineOptions(**opts))
    info = core.load_model(LoadSpec("bench", a.model_dir, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs))
    load_s = time.perf_counter() - t_load
    reqs = sharegpt_like(a.num_requests, info.vocab_size, 0)
    for j, n in enumerate((8, min(300, info.max_model_len - 8))):  # warm-up off the clock
        from engine.sampling import SamplingParams

        core.add_request(f"w{j}", "bench", reqs[0].prompt_token_ids[:1] * n,
                         SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    _drain(core)
    res = {"tp": tp, "device": torch.cuda.get_device_name(0) if cuda else f"CPU ({os.cpu_count()}-core)",
           "load_s": load_s, "device_bytes_per_gpu": info.device_bytes, "kv_pages": info.kv_pages,
           "workload_summary": summary(reqs)}
    res.update(_workload(core, reqs))
    res["batch1"] = _batch1(core, info.vocab_size, 256 if cuda else 32)
    res["greedy_probe"] = _greedy_probe(core, info.vocab_size)
    runner = core.slots.get("bench").runner
    res["graph_steps"] = getattr(runner, "graph_steps", None)
    if group is not None:
        res["control_bytes"] = core.channel.bytes_sent
        res["control_messages"] = core.channel.messages
        core.close()
        from engine.parallel.group import destroy_tp_group

        destroy_tp_group()
        res["follower_exit"] = [p.wait(timeout=120) for p in procs]
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir")
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--preset", default="tiny", help="generated when --model-dir is not given")
    ap.add_argument("--tp", default="1,2", help="comma-separated TP degrees (each <= GPUs on the host)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default: the engine's choice")
    ap.add_argument("--expect-match", action="store_true",
                    help="exit 1 unless every degree's greedy probe equals TP=1's (use with --dtype float32)")
    ap.add_argument("--timeout", type=float, default=280, help="seconds per TP degree")
    ap.add_argument("--out", help="JSON path for the combined result")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--one-out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    from engine.parallel.follower import dump_stacks_if_asked

    dump_stacks_if_asked()

    if a.one:
        Path(a.one_out).write_text(json.dumps(run_one(a)))
        return 0
    if not a.model_dir:
        from modelgen.make import make_model

        a.model_dir = str(make_model(Path(tempfile.mkdtemp(prefix="tp-bench-")) / "m", a.arch, a.preset,
                                     seed=0, device="cpu"))
    results, status = {}, 0
    for tp in [int(x) for x in a.tp.split(",") if x]:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, __file__, "--one", str(tp), "--one-out", f.name, "--model-dir", a.model_dir,
                   "--device", a.device, "--num-requests", str(a.num_requests), "--max-num-seqs", str(a.max_num_seqs),
                   "--max-num-batched-tokens", str(a.max_num_batched_tokens),
                   "--max-model-len", str(a.max_model_len), "--block-size", str(a.block_size)]
            if a.dtype:
                cmd += ["--dtype", a.dtype]
            try:
                rc = subprocess.run(cmd, timeout=a.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            if rc == 0:
                results[f"tp{tp}"] = json.loads(Path(f.name).read_text())
            else:
                results[f"tp{tp}"] = {"error": f"exit {rc}"}
                status = 1
    base = results.get("tp1", {}).get("greedy_probe")
    for key, r in results.items():
        if base and "greedy_probe" in r:
            r["greedy_match_vs_tp1"] = sum(x == y for x, y in zip(r["greedy_probe"], base)) / len(base)
            if a.expect_match and r["greedy_match_vs_tp1"] != 1.0:
                status = 1
    doc = {"workload": "sharegpt-like", "model_dir": a.model_dir, "results": results}
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1))
    keys = ("req_s", "output_tok_s", "total_tok_s", "ttft_ms_p50", "tpot_ms_p50", "tpot_ms_p99", "load_s",
            "device_bytes_per_gpu", "kv_pages", "graph_steps", "greedy_match_vs_tp1")
    print(f"{'':<22}" + "".join(f"{k:>14}" for k in results))
    for k in keys:
        print(f"{k:<22}" + "".join(f"{_fmt(r.get(k)):>14}" for r in results.values()))
    for k in ("decode_ms_per_token_p50", "prefill_ms"):
        print(f"batch1 {k:<15}" + "".join(f"{_fmt((r.get('batch1') or {}).get(k)):>14}" for r in results.values()))
    return status


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


if __name__ == "__main__":
    raise SystemExit(main())

"""Offline engine throughput on the sharegpt-like workload (``ops/bench/workload.py``), no HTTP in the way.

Every request is added to one in-process EngineCore at t0 (mode "offline"), or N are kept in
flight (``--concurrency N``, mode "concurrency-N"), and the engine is stepped until all finish.
Prints and saves one JSON result with the keys of docs/perf.md: req/s, output and total tok/s, TTFT and
TPOT p50/p99 (TTFT counts from when a request was added, so it includes queueing), and CPU cores
used (process CPU seconds per wall second).

    python -m ops.bench.engine_bench --model-dir DIR [--num-requests 1000] [--device auto]
    python -m ops.bench.engine_bench --arch llama --preset tiny --num-requests 100 --device cpu
    python -m ops.bench.engine_bench --model-dir /tmp/m8b --batch1 --peer 200     (the H200 run)

On CUDA decode steps replay CUDA graphs at ``--decode-buckets`` (default: the engine's buckets).
Default step shape: 512 sequences, 16384-token steps (the best offline shape on the H200); the
latency shape is ``--max-num-seqs 256 --max-num-batched-tokens 4096`` (half the TPOT).
``--batch1`` also times one request alone (128-token prompt, 256 tokens): decode ms per token.
``--peer N`` first runs transformers' ``generate_batch`` on the first N requests in a subprocess
(ops/bench/peer_hf.py), so the two never share GPU memory, and stores it under ``peer``.
Host cost per step: the runner's build+launch seconds and its wait for the ids, per step.

Prefix caching (issue 20): ``--workload shared-system`` (groups of 50 requests share a 1,024-token
system prompt) or ``multi-turn`` (``--num-requests`` conversations of ``--turns`` turns, each turn
sent when the previous one finished, resending the history with the model's own answers);
``--prefix-caching on|off|both``: ``both`` runs off then on in one process and reports the ratios
and whether every request's tokens were the same (``outputs_digest``).

FP8 (issue 19): ``--quantization fp8`` loads the model with FP8 projections; ``both`` runs bf16
then FP8 in one process and reports the FP8 run with ``vs_bf16_total_tok_s`` (and the batch-1
figures of both with ``--batch1``) and the bf16 run under ``bf16``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

from ops.bench.workload import (MULTI_TURN, NAME as WORKLOAD, SHARED_SYSTEM, BenchRequest, TokenTimes, multi_turn,
                                percentile, sharegpt_like, shared_system, summary)
from engine.load_spec import LoadSpec

REPO = Path(__file__).resolve().parents[2]


def host_info() -> dict:
    """The host's CPU model and core count: CPU figures (``cpu_cores``, restart seconds) differ
    by up to 2x between the GPU machines one session is lent (the same tree at c200 on the H200:
    0.47-0.72 cores on some, 0.27-0.28 on another, whose restarts also took 1.7 s, not 2.5)."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return {"cpu": model or platform.processor() or "unknown", "cores": os.cpu_count() or 0}


def save_result(result: dict, out: str | None, name: str) -> Path:
    """Print ``result`` as JSON (with the host's :func:`host_info`) and write it to ``out``
    (default: docs/perf/<name>.json)."""
    result.setdefault("host", host_info())
    text = json.dumps(result, indent=2)
    print(text)
    path = Path(out) if out else REPO / "docs" / "perf" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    return path


def _commit() -> str:
    if os.environ.get("INFIRE_COMMIT"):  # a copy without .git (the GPU machine's)
        return os.environ["INFIRE_COMMIT"]
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _device_name(core) -> str:
    if core.device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(core.device)
    return f"CPU ({os.cpu_count()}-core)"


def _batch1(core, vocab: int) -> dict:
    """One request alone: decode ms per token (median and p90 of step times after the first token)."""
    from engine.sampling import SamplingParams

    prompt = [100 + (i * 7919) % (vocab - 200) for i in range(128)]
    core.add_request("b1", "bench", prompt, SamplingParams(temperature=0, max_tokens=256, ignore_eos=True))
    times = []
    while core.has_unfinished_requests():
        t = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t)
    dec = sorted(times[1:])
    return {"decode_ms_per_token_p50": percentile(dec, 50) * 1e3, "decode_ms_per_token_p90": percentile(dec, 90) * 1e3,
            "prefill_ms": times[0] * 1e3, "tokens": len(times)}


def _profile(core, reqs, n_steps: int, rows: int) -> dict:
    """cProfile of the first ``n_steps`` steps of ``rows`` more requests (after the timed run: no
    skew). ``rows``: the engine's max_num_seqs, so the profiled decode steps run the timed run's
    largest buckets (Qwen3-30B-A3B's host time per graph step was 2.0 ms at 300 rows and 7.0 ms
    at 512 on the H200: a profile of fewer rows would not see what grows)."""
    import cProfile
    import pstats

    from engine.sampling import SamplingParams

    for i, r in enumerate(reqs[:rows]):
        core.add_request(f"p{i}", "bench", r.prompt_token_ids, SamplingParams(temperature=0, max_tokens=r.output_len,
                                                                            ignore_eos=True))
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for _ in range(n_steps):
        core.step()
    prof.disable()
    wall = time.perf_counter() - t
    while core.has_unfinished_requests():
        core.step()
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:25]
    return {"steps": n_steps, "wall_s": wall, "top_tottime": [
        {"fn": f"{Path(k[0]).name}:{k[1]}:{k[2]}", "ncalls": v[1], "tottime_s": v[2], "cumtime_s": v[3]}
        for k, v in rows]}


# A typical response_format schema (an API's record type): nested object, enum, bounded strings.
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 60},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
        "address": {"type": "object",
                    "properties": {"street": {"type": "string", "maxLength": 40},
                                   "city": {"type": "string", "maxLength": 24},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "city", "zip"], "additionalProperties": False},
        "status": {"enum": ["active", "inactive", "pending"]},
    },
    "required": ["name", "age", "email", "tags", "address", "status"],
    "additionalProperties": False,
}


def _grammar_setup(core, model_dir, info, tokenizer: str | None) -> tuple[str, dict]:
    """The bench schema's grammar, and what compiling costs: the agent's check, the worker's
    first compile (the tokenizer built before, timed apart) and a cached one."""
    from agent.http.structured import json_grammar
    from engine.grammar.compiler import GrammarCompiler

    t0 = time.perf_counter()
    grammar = json_grammar(BENCH_SCHEMA, True, "bench")
    check_ms = (time.perf_counter() - t0) * 1e3
    path = Path(tokenizer) if tokenizer else Path(model_dir) / "tokenizer.json"
    slot = core.slots.get("bench")
    slot.grammar = GrammarCompiler(path, info.vocab_size, info.eos_token_ids)
    core.compile_grammar("bench", json_grammar(None, False, "warm")).result()  # builds the tokenizer
    t1 = time.perf_counter()
    core.compile_grammar("bench", grammar).result()
    t2 = time.perf_counter()
    cached = []
    for _ in range(20):
        t = time.perf_counter()
        core.compile_grammar("bench", grammar).result()
        cached.append((time.perf_counter() - t) * 1e3)
    return grammar, {"tokenizer": str(path), "tokenizer_s": slot.grammar.tokenizer_seconds,
                     "schema_check_ms": check_ms, "compile_ms": (t2 - t1) * 1e3,
                     "compile_cached_ms_p50": percentile(cached, 50), "compile_cached_ms_max": max(cached)}


def _valid_json(eos_ids, tokens, constrained, tokenizer: str | None, model_dir) -> dict:
    """How many constrained outputs parse as JSON valid for the schema (those that ended by
    themselves; the rest hit max_tokens)."""
    from tokenizers import Tokenizer as HfTokenizer

    tok = HfTokenizer.from_file(str(tokenizer or Path(model_dir) / "tokenizer.json"))
    eos = set(eos_ids)
    ok = parsed = 0
    for rid in constrained:
        try:
            value = json.loads(tok.decode([t for t in tokens[rid] if t not in eos], skip_special_tokens=False))
        except ValueError:
            continue
        parsed += 1
        ok += isinstance(value, dict) and set(value) == set(BENCH_SCHEMA["required"])
    return {"parsed": parsed, "with_every_field": ok, "of": len(constrained)}


def _release_device(device: str) -> None:
    """Give the device back between runs of one process: the next run's engine sizes its budget
    from what is free, and the last one's KV pool and graph pools live until the cycle collector
    reaches them (with ``--prefix-caching both`` the second run saw 13 of 140 GiB free)."""
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(torch.device(device))
        print(f"device released: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free", file=sys.stderr)


def run_bench(model_dir: str | Path, num_requests: int, device: str, max_num_seqs: int, max_num_batched_tokens: int,
              max_model_len: int, block_size: int, seed: int = 0, concurrency: int | None = None,
              decode_buckets: tuple[int, ...] | None = None, batch1: bool = False, profile_steps: int = 0,
              async_steps: bool | None = None, workload: str = WORKLOAD, prefix_caching: bool = True,
              turns: int = 5, outputs: dict[str, list[int]] | None = None, constrained_every: int = 0,
              grammar_tokenizer: str | None = None, quantization: str | None = None,
              kv_cache_dtype: str | None = None) -> dict:
    """Run the workload; ``concurrency`` None adds every request at t0, N keeps N in flight (for
    multi-turn: N conversations). ``outputs``, when given, receives every request's tokens.
    ``constrained_every`` N > 0: every N-th request's output is constrained to
    :data:`BENCH_SCHEMA` (it ends when its JSON does), the grammar compiled over
    ``grammar_tokenizer`` (a tokenizer.json; None: the model's own)."""
    from engine.core.engine_core import EngineCore
    from engine.options import EngineOptions
    from engine.runner.cuda_graphs import DEFAULT_BUCKETS
    from engine.sampling import SamplingParams

    if decode_buckets is None:
        decode_buckets = DEFAULT_BUCKETS
    core = EngineCore(EngineOptions(max_num_batched_tokens=max_num_batched_tokens, block_size=block_size, seed=seed,
                                    decode_buckets=decode_buckets, async_steps=async_steps is not False),
                      device=device)
    if core.device.type == "cuda":
        import torch

        torch.set_num_threads(1)  # as the worker: a step's host tensors are tiny
    t_load = time.perf_counter()
    info = core.load_model(LoadSpec("bench", model_dir, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                    prefix_caching=prefix_caching, quantization=quantization,
                                    kv_cache_dtype=kv_cache_dtype))
    load_s = time.perf_counter() - t_load
    runner = core.slots.get("bench").runner
    # Graphs deferred to their first use are captured now, outside the clock (a server pays
    # this once per load; reported as deferred_capture_s).
    deferred_capture_s = runner.capture_deferred_graphs()
    source = _Source(workload, num_requests, info.vocab_size, seed, info.max_model_len, turns)
    reqs = source.first_turns
    # Warm-up outside the clock (first-call allocations, kernel compiles for short and long queries).
    for j, n in enumerate((8, min(300, info.max_model_len - 8))):
        core.add_request(f"warmup{j}", "bench", reqs[0].prompt_token_ids[:1] * n,
                         SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while core.has_unfinished_requests():
        core.step()

    grammar_text, grammar_info, constrained = None, {}, set()
    if constrained_every:
        grammar_text, grammar_info = _grammar_setup(core, model_dir, info, grammar_tokenizer)
    times = TokenTimes()
    limit = concurrency or source.num_streams
    in_flight = 0
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    sent: list[BenchRequest] = []

    def send_more() -> None:
        nonlocal in_flight
        while in_flight < limit and (nxt := source.next()) is not None:
            rid, r = nxt
            times.sent[rid] = time.perf_counter()
            tokens[rid] = []
            sent.append(r)
            grammar = None
            if constrained_every and len(sent) % constrained_every == 0:
                constrained.add(rid)
                grammar = core.compile_grammar("bench", grammar_text).result()
            core.add_request(rid, "bench", r.prompt_token_ids,
                             SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True), grammar=grammar)
            in_flight += 1

    host0, wait0, graph0, mixed0 = runner.host_seconds, runner.wait_seconds, runner.graph_steps, runner.mixed_graph_steps
    hostg0 = runner.host_graph_seconds
    casc0 = (runner.cascade_rows, runner.cascade_steps)
    cpu0, t0 = time.process_time(), time.perf_counter()
    send_more()
    steps = 0
    step_ms: dict[str, list[float]] = {"graph": [], "mixed": [], "eager": []}
    while core.has_unfinished_requests():
        g_before, m_before, t_step = runner.graph_steps, runner.mixed_graph_steps, time.perf_counter()
        outs = core.step()
        now = time.perf_counter()
        kind = ("graph" if runner.graph_steps != g_before else
                "mixed" if runner.mixed_graph_steps != m_before else "eager")
        step_ms[kind].append((now - t_step) * 1e3)
        steps += 1
        times.observe(outs, now)
        for o in outs:
            tokens[o.req_id] += o.new_token_ids
            cached[o.req_id] = o.num_cached_tokens
            if o.finish_reason is not None:
                in_flight -= 1
                source.finished(o.req_id, tokens[o.req_id])
        send_more()
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    host_ms = (runner.host_seconds - host0) * 1e3 / max(steps, 1)
    wait_ms = (runner.wait_seconds - wait0) * 1e3 / max(steps, 1)
    # The runner's counters are read here: _batch1 and _profile step it again, and the unload
    # below keeps it as a vacancy, which starts its counters over.
    mixed_steps = runner.mixed_graph_steps - mixed0
    graph_steps = runner.graph_steps - graph0 + mixed_steps
    cascade = (runner.cascade_rows - casc0[0], runner.cascade_steps - casc0[1])
    mask_s, masked_rows, masked_steps = runner.mask_seconds, runner.masked_rows, runner.masked_steps
    host_g = runner.host_graph_seconds - hostg0
    host_e = runner.host_seconds - host0 - host_g
    host_by_kind = {"graph_ms_per_step": host_g * 1e3 / max(graph_steps, 1),
                    "eager_ms_per_step": host_e * 1e3 / max(steps - graph_steps, 1),
                    "deferred_capture_s": deferred_capture_s}
    b1 = _batch1(core, info.vocab_size) if batch1 else None
    prof = _profile(core, reqs, profile_steps, max_num_seqs) if profile_steps else None
    graphs = runner.graphs
    total_out = times.output_tokens
    total_in = sum(r.input_len for r in sent)
    digest = hashlib.sha256(json.dumps(sorted(tokens.items())).encode()).hexdigest()[:16]
    core.unload_model("bench")
    if outputs is not None:
        outputs.update(tokens)
    return {
        "gpu": _device_name(core),
        "workload": workload,
        "prefix_caching": prefix_caching,
        "quantization": quantization or "none",
        "kv_cache_dtype": kv_cache_dtype or "auto",
        "kv_pages": info.kv_pages,
        "weight_bytes": info.device_bytes,
        "requests": len(sent),
        "req_s": len(sent) / wall,
        "output_tok_s": total_out / wall,
        "total_tok_s": (total_out + total_in) / wall,
        **times.latency(),
        "cpu_cores": cpu / wall,
        "wall_s": wall,
        "steps": steps,
        "output_tokens": total_out,
        "input_tokens": total_in,
        "workload_summary": summary(sent),
        "cached_tokens": sum(cached.values()),
        "cached_fraction": sum(cached.values()) / max(total_in, 1),
        **({"constrained": {"requests": len(constrained), **grammar_info,
                            "latency": times.latency(constrained),
                            "free_latency": times.latency(set(times.first) - constrained),
                            "mask_s": mask_s, "masked_rows": masked_rows, "masked_steps": masked_steps,
                            "mask_us_per_row": mask_s * 1e6 / max(masked_rows, 1),
                            "valid_json": _valid_json(info.eos_token_ids, tokens, constrained, grammar_tokenizer, model_dir)}}
           if constrained_every else {}),
        "outputs_digest": digest,
        "step_ms_mean": wall * 1e3 / max(steps, 1),
        "steps_by_kind": {k: {"steps": len(v), "ms_mean": sum(v) / len(v) if v else None,
                              "ms_total": sum(v)} for k, v in step_ms.items()},
        "host_ms_per_step": host_ms,
        "wait_ms_per_step": wait_ms,
        "host_ms_by_kind": host_by_kind,
        "profile": prof,
        "cpu_ms_per_step": cpu * 1e3 / max(steps, 1),
        "graph_steps": graph_steps,
        "mixed_graph_steps": mixed_steps,
        # cascade attention (engine/runner/cascade.py): one-token rows that read a shared prefix
        # once a tile, and the steps that had such rows
        "cascade": {"rows": cascade[0], "steps": cascade[1], "rows_per_output_token": cascade[0] / max(total_out, 1)},
        "mixed_capture_s": runner.mixed.capture_seconds if runner.mixed else None,
        "load_s": load_s,
        "graph_capture_s": graphs.capture_seconds if graphs else None,
        "graph_warmup_s": graphs.warmup_seconds if graphs else None,
        "batch1": b1,
        "engine": {"async_steps": core.async_steps, "decode_buckets": list(runner.decode_buckets), "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                   "max_model_len": info.max_model_len, "block_size": block_size, "kv_pages": info.kv_pages},
    }


class _Source:
    """What the bench sends next: the workload's requests in order, or, for multi-turn, each
    conversation's next turn once its previous one finished (history + the model's answer)."""

    def __init__(self, workload: str, n: int, vocab: int, seed: int, max_len: int, turns: int) -> None:
        self.convs: list = []
        if workload == MULTI_TURN:
            self.convs = multi_turn(n, turns, vocab, seed, max_total=max_len)
            self.ready = deque((c, 0, []) for c in range(len(self.convs)))  # (conversation, turn, history)
            self.first_turns = [BenchRequest(conv.user_turns[0], conv.output_lens[0]) for conv in self.convs]
            self.num_streams = len(self.convs)
        else:
            reqs = shared_system(n, vocab, seed) if workload == SHARED_SYSTEM else sharegpt_like(n, vocab, seed)
            too_long = [r for r in reqs if r.input_len + r.output_len > max_len]
            if too_long:
                raise SystemExit(f"{len(too_long)} requests exceed max_model_len={max_len}; raise --max-model-len")
            self.ready = deque((None, i, r) for i, r in enumerate(reqs))
            self.first_turns = reqs
            self.num_streams = len(reqs)
        self._turn_of: dict[str, tuple[int, int, list[int]]] = {}

    def next(self) -> tuple[str, BenchRequest] | None:
        if not self.ready:
            return None
        c, t, x = self.ready.popleft()
        if c is None:
            return f"r{t}", x
        conv = self.convs[c]
        prompt = x + conv.user_turns[t]
        self._turn_of[f"c{c}t{t}"] = (c, t, prompt)
        return f"c{c}t{t}", BenchRequest(prompt, conv.output_lens[t])

    def finished(self, req_id: str, answer: list[int]) -> None:
        if req_id in self._turn_of:
            c, t, prompt = self._turn_of.pop(req_id)
            if t + 1 < len(self.convs[c].user_turns):
                self.ready.append((c, t + 1, prompt + answer))


def compare_outputs(a: dict[str, list[int]], b: dict[str, list[int]]) -> dict:
    """How far two runs' greedy tokens agree, request by request: the fraction identical, and for
    the others where they part (a near-tie that rounding tips the other way changes every token
    after it, so the first divergence is the figure that means something)."""
    common = sorted(a.keys() & b.keys())
    parted = []
    for rid in common:
        x, y = a[rid], b[rid]
        if x != y:
            parted.append(next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y))))
    return {"requests": len(common), "only_in_one": len(a.keys() ^ b.keys()),
            "same_fraction": (len(common) - len(parted)) / max(len(common), 1),
            "first_divergence_p50": percentile(parted, 50) if parted else None,
            "first_divergence_min": min(parted) if parted else None}


def _run_peer(model_dir: str | Path, n: int, timeout: float = 900) -> dict:
    """transformers' generate_batch in its own process (its memory is gone before ours is taken)."""
    cmd = [sys.executable, "-m", "ops.bench.peer_hf", "--model-dir", str(model_dir), "--num-requests", str(n)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"error": f"exit {p.returncode}: {p.stderr[-2000:]}"}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="offline engine throughput (sharegpt-like workload)")
    ap.add_argument("--model-dir", help="model folder; without it one is generated from --arch/--preset")
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--device", default="auto")
    # the offline shape that won the H200 sweep (docs/perf.md, 2026-11-30); for latency use 256 / 4096
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--concurrency", type=int, help="requests kept in flight (default: all at once, mode offline)")
    ap.add_argument("--decode-buckets", help="comma-separated decode batch buckets ('' = none)")
    ap.add_argument("--batch1", action="store_true", help="also time batch-1 decode")
    ap.add_argument("--peer", type=int, default=0, help="run transformers generate_batch on the first N requests")
    ap.add_argument("--weights-on-device", action="store_true",
                    help="with --arch/--preset: no checkpoint on disk, random weights made on the device "
                         "(ops/bench/device_weights.py; full-size shapes the disk cannot hold)")
    ap.add_argument("--profile-steps", type=int, default=0, help="cProfile this many steps after the timed run")
    ap.add_argument("--peer-timeout", type=float, default=900)
    ap.add_argument("--out", help="JSON path (default: docs/perf/<date>-engine-<model>-<commit>.json)")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--sync", action="store_true", help="synchronous steps (default on CUDA: asynchronous)")
    ap.add_argument("--workload", choices=[WORKLOAD, SHARED_SYSTEM, MULTI_TURN], default=WORKLOAD)
    ap.add_argument("--turns", type=int, default=5, help="turns per conversation (multi-turn)")
    ap.add_argument("--prefix-caching", choices=["on", "off", "both"], default="on")
    ap.add_argument("--quantization", choices=["none", "fp8", "both"], default="none",
                    help="both: bf16 then FP8 in one process (one caching mode)")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                    help="fp8: an e4m3 KV cache (with --quantization both: for the FP8 run only)")
    ap.add_argument("--constrained-every", type=int, default=0,
                    help="N > 0: every N-th request JSON-schema constrained; runs the workload free first, then so")
    ap.add_argument("--grammar-tokenizer", help="tokenizer.json the grammar is compiled over (default: the model's)")
    ap.add_argument("--control-concurrency", type=int,
                    help="with --prefix-caching both: a third run, caching off at this concurrency, to show how "
                         "much a different batch composition alone changes greedy tokens")
    a = ap.parse_args(argv)
    if a.control_concurrency is not None and a.prefix_caching != "both":
        ap.error("--control-concurrency needs --prefix-caching both")
    if a.constrained_every and a.prefix_caching == "both":
        ap.error("--constrained-every runs one caching mode (on or off)")
    if a.quantization == "both" and (a.prefix_caching == "both" or a.constrained_every or a.control_concurrency):
        ap.error("--quantization both runs one caching mode, unconstrained")
    quants = {"none": (None,), "fp8": ("fp8",), "both": (None, "fp8")}[a.quantization]

    if a.weights_on_device and (a.model_dir or a.peer):
        ap.error("--weights-on-device makes its own weights: not with --model-dir or --peer")
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        model_dir = a.model_dir
        model_name = Path(model_dir).name if model_dir else f"{a.arch}-{a.preset} (random, make-model)"
        if a.weights_on_device:
            from modelgen.make import make_metadata_only
            from ops.bench.device_weights import filling_on_device

            model_dir = make_metadata_only(Path(tmp) / "model", a.arch, a.preset)
            model_name = f"{a.arch}-{a.preset} (random, made on the device)"
            stack.enter_context(filling_on_device())
        elif not model_dir:
            from modelgen.make import make_model

            model_dir = make_model(Path(tmp) / "model", a.arch, a.preset, seed=0)
        peer = _run_peer(model_dir, a.peer, a.peer_timeout) if a.peer else None
        buckets = None if a.decode_buckets is None else tuple(int(x) for x in a.decode_buckets.split(",") if x)
        runs, outputs = {}, {}
        modes = ("off", "on") if a.prefix_caching == "both" else (a.prefix_caching,)
        if a.control_concurrency is not None:
            modes += ("control",)
        if a.constrained_every:
            modes = (a.prefix_caching, "constrained")
        if len(quants) > 1:
            modes = ("bf16", "fp8")
        for mode in modes:
            quant = "fp8" if mode == "fp8" else quants[0] if mode != "bf16" else None
            outputs[mode] = {}
            runs[mode] = run_bench(model_dir, a.num_requests, a.device, a.max_num_seqs, a.max_num_batched_tokens,
                                   a.max_model_len, a.block_size,
                                   concurrency=a.control_concurrency if mode == "control" else a.concurrency,
                                   decode_buckets=buckets, batch1=a.batch1, profile_steps=a.profile_steps,
                                   async_steps=False if a.sync else None, workload=a.workload,
                                   prefix_caching=mode == "on" or (mode in ("constrained", "bf16", "fp8") and a.prefix_caching == "on"),
                                   turns=a.turns, outputs=outputs[mode],
                                   constrained_every=a.constrained_every if mode == "constrained" else 0,
                                   grammar_tokenizer=a.grammar_tokenizer, quantization=quant,
                                   kv_cache_dtype=("fp8" if a.kv_cache_dtype == "fp8" and (quant or len(quants) == 1)
                                                   else None))
            _release_device(a.device)
        if a.constrained_every:
            free, con = runs[a.prefix_caching], runs["constrained"]
            res = {**con, "free_run": free,
                   "constrained_vs_free_total_tok_s": con["total_tok_s"] / free["total_tok_s"],
                   "constrained_tpot_vs_free_p50": ((con["constrained"]["latency"]["tpot_ms_p50"] or 0)
                                                    / (con["constrained"]["free_latency"]["tpot_ms_p50"] or 1))}
        elif len(quants) > 1:
            res = {**runs["fp8"], "bf16": runs["bf16"],
                   "vs_bf16_total_tok_s": runs["fp8"]["total_tok_s"] / runs["bf16"]["total_tok_s"],
                   "vs_bf16_outputs": compare_outputs(outputs["fp8"], outputs["bf16"])}
        elif a.prefix_caching != "both":
            res = runs[a.prefix_caching]
        else:
            res = {
                **runs["on"], "caching_off": runs["off"],
                "on_vs_off_total_tok_s": runs["on"]["total_tok_s"] / runs["off"]["total_tok_s"],
                "on_vs_off_ttft_p50": (runs["on"]["ttft_ms_p50"] or 0) / (runs["off"]["ttft_ms_p50"] or 1),
                "same_outputs": runs["on"]["outputs_digest"] == runs["off"]["outputs_digest"],
                "on_vs_off_outputs": compare_outputs(outputs["on"], outputs["off"])}
        if "control" in runs:
            res["control"] = {"concurrency": a.control_concurrency, "total_tok_s": runs["control"]["total_tok_s"],
                              "off_vs_control_outputs": compare_outputs(outputs["off"], outputs["control"])}
    if peer and peer.get("total_tok_s"):
        res["vs_peer_total_tok_s"] = res["total_tok_s"] / peer["total_tok_s"]
    commit = _commit()
    now = dt.datetime.now(dt.timezone.utc)
    result = {
        "date": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit,
        "command": "python -m ops.bench.engine_bench " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:])),
        "model": model_name,
        "workload": a.workload,
        "mode": f"concurrency-{a.concurrency}" if a.concurrency else "offline",
        **res,
        "cpu_count": os.cpu_count(),
        "peer": peer,
    }
    if a.no_save:
        print(json.dumps(result, indent=2))
    else:
        slug = "".join(c if c.isalnum() or c in "-." else "-" for c in model_name.split(" ")[0])
        out = save_result(result, a.out, f"{now:%Y%m%d-%H%M}-engine-{slug}-{commit}")
        print(f"saved {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

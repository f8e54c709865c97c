"""Long prompts through the daemon (issue 38): how fast one prefills, and what long prefills do to
everyone else's decode.

Two phases against one daemon (started here on ``--model-dir`` or a generated model, or
``--url``), prompts as random token ids (no prefix-cache hits), ``ignore_eos``, streamed:

1. **single**: one request at a time at each of ``--lengths`` (8k, 32k, 64k, 120k by default),
   ``--out-tokens`` out: TTFT, prefill tok/s (prompt tokens / TTFT), TPOT.
2. **mixed**: ``--long-n`` prompts of ``--long-len`` tokens sent at once beside a stream of short
   requests (``--short-len`` in, ``--short-out`` out) kept at ``--short-concurrency`` in flight
   from before the long ones start until the last long one is done: the long ones' TTFT, and the
   TPOT and TTFT of the short requests that overlap that window (what a decode pays for the
   prefills beside it).

    python -m ops.bench.long_context_bench --model-dir /tmp/m8b --device cuda --max-model-len 131072
    python -m ops.bench.long_context_bench --preset tiny --device cpu --lengths 64,128 --long-len 96 \\
        --long-n 2 --short-concurrency 2 --max-model-len 256        (a smoke run)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import random
import shlex
import sys
import time
from typing import Any

from ops.bench.engine_bench import _commit, save_result
from ops.bench.serve_bench import _admin_status, _one, started_agent
from ops.bench.workload import percentile


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]  # clear of the special ids at the low end


def _ms(xs: list[float], q: float) -> float | None:
    return round(percentile(xs, q) * 1000, 1) if xs else None


async def single(session: Any, url: str, model: str, lengths: list[int], out: int, vocab: int, seed: int) -> list[dict]:
    rows = []
    for i, n in enumerate(lengths):
        r = await _one(session, url, model, _ids(random.Random(seed + i), n, vocab), out, seed + i, {})
        if "error" in r:
            rows.append({"prompt": n, "error": r["error"]})
            continue
        rows.append({"prompt": n, "ttft_s": round(r["ttft"], 3), "prefill_tok_s": round(n / r["ttft"]),
                     "tpot_ms": round(r["tpot"] * 1000, 2) if r["tpot"] else None, "out": r["out"]})
    return rows


_STEP_FIGURES = ("steps", "decode_graph_steps", "mixed_graph_steps", "host_s", "wait_s", "cascade_steps",
                 "cascade_long_rows")


def _engine_figures(url: str, model: str, token: str) -> dict | None:
    """The model's step counters from the agent's status (None without an admin token)."""
    if not token:
        return None
    row = (_admin_status(url, token).get("engine") or {}).get("models", {}).get(model) or {}
    return {k: row.get(k, 0) for k in _STEP_FIGURES}


def _step_split(before: dict | None, after: dict | None, seconds: float) -> dict | None:
    """What the engine's steps did over a window: how many, their mean wall time, the share
    replayed from graphs, and host / waiting seconds a step. The worker reports its status every
    0.25 s: the counters are read before the window and a second after it (so that they cover
    it), and ``seconds`` spans the two reads."""
    if not before or not after:
        return None
    d = {k: after[k] - before[k] for k in _STEP_FIGURES}
    n = d["steps"]
    if n <= 0:
        return {"steps": n}
    return {"steps": n, "step_ms": round(seconds / n * 1000, 2),
            "decode_graph_share": round(d["decode_graph_steps"] / n, 3),
            "mixed_graph_share": round(d["mixed_graph_steps"] / n, 3),
            "host_ms_per_step": round(d["host_s"] / n * 1000, 3), "wait_ms_per_step": round(d["wait_s"] / n * 1000, 3),
            # steps with a cascade plan, and the long rows split by one a step (engine/runner/cascade.py)
            "cascade_share": round(d["cascade_steps"] / n, 3),
            "long_rows_per_step": round(d["cascade_long_rows"] / n, 3)}


async def mixed(session: Any, url: str, model: str, a: argparse.Namespace, vocab: int, token: str = "") -> dict:
    rng = random.Random(a.seed + 1000)
    short: list[dict] = []
    done = asyncio.Event()

    async def stream(k: int) -> None:
        j = 0
        while not done.is_set():
            r = await _one(session, url, model, _ids(rng, a.short_len, vocab), a.short_out, 10_000 * (k + 1) + j, {})
            r["t_end"] = time.perf_counter()
            short.append(r)
            j += 1

    streams = [asyncio.create_task(stream(k)) for k in range(a.short_concurrency)]
    await asyncio.sleep(a.short_lead_s)  # the short stream at its pace before the long prompts come
    before = await asyncio.to_thread(_engine_figures, url, model, token)
    t0 = time.perf_counter()
    longs = await asyncio.gather(*(_one(session, url, model, _ids(random.Random(a.seed + 2000 + i), a.long_len, vocab),
                                        a.out_tokens, 2000 + i, {}) for i in range(a.long_n)))
    t1 = time.perf_counter()
    await asyncio.sleep(1.0)  # four of the worker's status intervals: a busy box sends them late
    after = await asyncio.to_thread(_engine_figures, url, model, token)
    ta = time.perf_counter()
    done.set()
    await asyncio.gather(*streams)
    window = [r for r in short if "error" not in r and r["t_end"] > t0 and r["t_end"] - r["e2e"] < t1]
    errors = sum("error" in r for r in short) + sum("error" in r for r in longs)
    ok_long = [r for r in longs if "error" not in r]
    tpot = [r["tpot"] for r in window if r["tpot"]]
    return {"long_n": a.long_n, "long_len": a.long_len, "short_concurrency": a.short_concurrency,
            "window_s": round(t1 - t0, 2), "errors": errors,
            "first_error": next((r["error"] for r in [*longs, *short] if "error" in r), None),
            "long_ttft_ms_p50": _ms([r["ttft"] for r in ok_long], 50),
            "long_ttft_ms_max": _ms([r["ttft"] for r in ok_long], 100),
            "short_requests_in_window": len(window),
            "short_tpot_ms_p50": _ms(tpot, 50), "short_tpot_ms_p99": _ms(tpot, 99),
            "short_ttft_ms_p50": _ms([r["ttft"] for r in window], 50),
            "short_ttft_ms_p99": _ms([r["ttft"] for r in window], 99),
            "engine_steps": _step_split(before, after, ta - t0)}


async def run(url: str, model: str, a: argparse.Namespace, vocab: int, token: str = "") -> dict:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_read=1800)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        # one-off work (first compiles, deferred graph captures) out of the measured phases
        await _one(session, url, model, _ids(random.Random(a.seed - 1), min(a.lengths), vocab), 4, 0, {})
        out: dict[str, Any] = {}
        if "single" in a.phases:
            out["single"] = await single(session, url, model, a.lengths, a.out_tokens, vocab, a.seed)
        if "mixed" in a.phases:
            out["mixed"] = await mixed(session, url, model, a, vocab, token)
        return out


def _lengths(text: str) -> list[int]:
    try:
        v = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"lengths are integers separated by commas, got {text!r}") from None
    if not v or min(v) < 1:
        raise argparse.ArgumentTypeError(f"lengths must be >= 1, got {text!r}")
    return v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running agent (default: start one)")
    ap.add_argument("--model", help="model name on --url")
    ap.add_argument("--admin-token", default="", help="with --url: to read the model's vocabulary")
    ap.add_argument("--vocab-size", type=int, help="default: the model's")
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--model-dir", help="serve this model folder instead of a generated one")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-model-len", type=int, default=131072)
    ap.add_argument("--max-num-seqs", type=int, default=96)
    ap.add_argument("--phases", default="single,mixed", help="single, mixed or both (comma-separated)")
    ap.add_argument("--lengths", type=_lengths, default=[8192, 32768, 65536, 120000])
    ap.add_argument("--out-tokens", type=int, default=64)
    ap.add_argument("--long-n", type=int, default=8)
    ap.add_argument("--long-len", type=int, default=32768)
    ap.add_argument("--short-concurrency", type=int, default=64)
    ap.add_argument("--short-len", type=int, default=256)
    ap.add_argument("--short-out", type=int, default=128)
    ap.add_argument("--short-lead-s", type=float, default=3.0, help="the short stream alone before the long prompts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--decode-step-tokens", type=int,
                    help="the started agent's [engine] decode_step_tokens (default: the daemon's)")
    ap.add_argument("--out", help="JSON path (default: docs/perf/<date>-long-context-<model>-<commit>.json)")
    a = ap.parse_args(argv)
    if a.decode_step_tokens is not None and (a.url or a.decode_step_tokens < 1):
        ap.error("--decode-step-tokens is a setting of the started agent: >= 1, and not with --url")
    a.phases = {p.strip() for p in a.phases.split(",") if p.strip()}
    if not a.phases or a.phases - {"single", "mixed"}:
        ap.error("--phases takes single, mixed or both")
    longest = max(max(a.lengths), a.long_len, a.short_len) + max(a.out_tokens, a.short_out)
    if longest > a.max_model_len:
        ap.error(f"a prompt and its output ({longest} tokens) exceed --max-model-len {a.max_model_len}")
    for name in ("out_tokens", "long_n", "long_len", "short_concurrency", "short_len", "short_out"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    a.quantization, a.kv_cache_dtype = "none", "auto"  # (prepare_agent reads them)
    with contextlib.ExitStack() as stack:
        if a.url:
            url, model = a.url.rstrip("/"), a.model
            if not model:
                ap.error("--model is needed with --url")
            token = a.admin_token
            st = _admin_status(url, token) if token else {}
        else:
            _, url, model, token = stack.enter_context(started_agent(a, "long-bench-"))
            st = _admin_status(url, token)
        info = next((m for m in st.get("models", []) if m["name"] == model), {})
        vocab = a.vocab_size or info.get("vocab_size")
        if not vocab:
            ap.error("--vocab-size is needed (no admin token to read it from the agent)")
        result = asyncio.run(run(url, model, a, vocab, token))
        device = (st.get("worker") or {}).get("device") or a.device
    now = dt.datetime.now(dt.timezone.utc)
    commit = _commit()
    report = {"date": now.isoformat(timespec="seconds"), "gpu": device if "cuda" in str(device) else f"none ({device})",
              "commit": commit, "command": "python -m ops.bench.long_context_bench " + shlex.join(argv or sys.argv[1:]),
              "model": model, "max_model_len": a.max_model_len, "decode_step_tokens": a.decode_step_tokens,
              **result}
    save_result(report, a.out, f"{now:%Y%m%d-%H%M}-long-context-{model}-{commit}")
    bad = any("error" in r for r in report.get("single", [])) or (report.get("mixed") or {}).get("errors", 0)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

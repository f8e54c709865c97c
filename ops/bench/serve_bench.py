"""Serving benchmark: the sharegpt-like workload (``ops/bench/workload.py``) through the agent's HTTP API.

Streams ``POST /v1/completions`` (prompt as token ids, ``ignore_eos``, ``max_tokens`` = the
drawn output length, usage in the last chunk) at a fixed concurrency or an arrival rate
(``inf`` = all at once), and reports req/s, output and total tok/s, TTFT and TPOT p50/p99, and
the CPU cores used by the agent's whole process tree (agent, worker, any other descendant; utime +
stime from /proc per wall second).
Either point it at a running agent (``--url``; CPU figures need it to be on this machine) or let
it start one on a generated model (``--arch/--preset`` or ``--model-dir``).

    python -m ops.bench.serve_bench --arch llama --preset tiny --num-requests 50 --concurrency 8
    python -m ops.bench.serve_bench --url http://127.0.0.1:8080 --model NAME --concurrency 200

The load generator runs in this process; on a small machine it competes with the agent for CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import os
import random
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agent.http import sse
from ops.bench.engine_bench import _commit, save_result
from ops.bench.gauge_sampler import GaugeSampler, scrape
from ops.bench.workload import percentile
from ops.bench.workload import NAME as WORKLOAD, sharegpt_like, summary


def cpu_seconds(pid: int | None) -> float:
    """utime + stime of a process (0 when it is gone or not on this machine)."""
    if not pid:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_pids(agent: int | None, worker: int | None) -> dict[str, set[int]]:
    """The agent's process tree split into the agent, the worker and every other descendant (the
    worker's included): tokenizers, compilers, anything a child started."""
    import psutil

    children: set[int] = set()
    if agent:
        try:
            children = {c.pid for c in psutil.Process(agent).children(recursive=True)}
        except psutil.Error:
            pass
    return {"agent": {agent} if agent else set(), "worker": {worker} if worker else set(),
            "children": children - {agent, worker}}


def tree_cpu_seconds(parts: dict[str, set[int]]) -> dict[str, dict[int, float]]:
    """utime + stime of each process of ``tree_pids``'s parts."""
    return {k: {pid: cpu_seconds(pid) for pid in pids} for k, pids in parts.items()}


def tree_cpu_delta(before: dict[str, dict[int, float]], after: dict[str, dict[int, float]]) -> dict[str, float]:
    """CPU seconds each part used between two readings; a process seen only in ``after`` counts
    whole (it started in between), one seen only in ``before`` not at all (its time is lost with it)."""
    out = {}
    for k, now in after.items():
        then = before.get(k, {})
        out[k] = sum(max(0.0, v - then.get(pid, 0.0)) for pid, v in now.items())
    return out


# What a penalised request of --penalised-fraction asks for: every rule the engine applies on
# the device (engine/runner/logit_rules.py), at values clients send.
PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}


async def _one(session: Any, url: str, model: str, ids: list[int], out_len: int, seed: int, headers: dict,
               penalised: bool = False) -> dict:
    body = {"model": model, "prompt": ids, "max_tokens": out_len, "ignore_eos": True, "temperature": 1.0,
            "seed": seed, "stream": True, "stream_options": {"include_usage": True},
            **(PENALTIES if penalised else {})}
    t0 = time.perf_counter()
    first = None
    usage: dict = {}
    async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {(await resp.text())[:200]}"}
        async for line in resp.content:
            chunk = sse.parse_line(line)
            if chunk is None:
                continue
            if chunk is sse.DONE:
                break
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                first = time.perf_counter()
    end = time.perf_counter()
    n_out = usage.get("completion_tokens", 0)
    first = first or end
    return {"ttft": first - t0, "e2e": end - t0, "out": n_out, "in": usage.get("prompt_tokens", len(ids)),
            "tpot": (end - first) / (n_out - 1) if n_out > 1 else None, "penalised": penalised}


async def drive(url: str, model: str, reqs: list[Any], concurrency: int | None, rate: float | None,
                api_key: str = "", seed: int = 0, penalised_fraction: float = 0.0) -> tuple[list[dict], float]:
    """Send ``reqs``; a seeded ``penalised_fraction`` of them carry PENALTIES."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    rng = random.Random(seed)
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

        marked = random.Random(seed + 7)
        penalised = [marked.random() < penalised_fraction for _ in reqs]

        async def run(i: int, r: Any) -> dict:
            if sem is None:
                return await _one(session, url, model, r.prompt_token_ids, r.output_len, i, headers, penalised[i])
            async with sem:
                return await _one(session, url, model, r.prompt_token_ids, r.output_len, i, headers, penalised[i])

        t0 = time.perf_counter()
        tasks = []
        for i, r in enumerate(reqs):
            tasks.append(asyncio.create_task(run(i, r)))
            if rate and rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks, return_exceptions=True)
        wall = time.perf_counter() - t0
    return [r if isinstance(r, dict) else {"error": repr(r)} for r in results], wall


def start_profile(folder: Path, pids: dict[str, int | None], native: bool = False) -> dict[str, Any]:
    """One ``py-spy record`` per process (sampling, no pause of the target: ``--nonblocking``),
    writing collapsed stacks to ``folder/<part>.txt``; none when py-spy is not installed.
    ``native``: C frames too (where a sample inside a torch call spends it: a driver wait, an
    allocation), which pauses the target at each sample."""
    import shutil
    import subprocess

    spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if spy is None:
        print("serve_bench: py-spy not found; no profile", file=sys.stderr)
        return {}
    folder.mkdir(parents=True, exist_ok=True)
    spies = {}
    for part, pid in pids.items():
        if pid:
            cmd = [spy, "record", "--pid", str(pid), "--rate", "200", "--threads",
                   "--format", "raw", "--output", str(folder / f"{part}.txt")]
            cmd += ["--native"] if native else ["--nonblocking"]
            spies[part] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(folder / f"{part}.log", "wb"))
    time.sleep(0.5)  # attached before the first request
    return spies


def stop_profile(folder: Path, spies: dict[str, Any], top: int = 40) -> None:
    """Stop the samplers (SIGINT: they write their file) and sum the top functions of each part:
    self samples (where the CPU was) and total samples (what was on the stack)."""
    import signal as _signal

    for p in spies.values():
        p.send_signal(_signal.SIGINT)
    summary: dict[str, Any] = {}
    for part, p in spies.items():
        try:
            p.wait(30)
        except Exception:
            p.kill()
        path = folder / f"{part}.txt"
        if path.exists():
            summary[part] = top_functions(path.read_text(errors="replace"), top)
    (folder / "profile.json").write_text(json.dumps(summary, indent=1))


def top_functions(collapsed: str, top: int = 40) -> dict[str, Any]:
    """From collapsed stacks (``frame;frame;... count`` lines), the samples, and the ``top``
    functions by self and by total samples."""
    own: dict[str, int] = {}
    total: dict[str, int] = {}
    n = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        c = int(count)
        n += c
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]  # a function, not a line
        own[frames[-1]] = own.get(frames[-1], 0) + c
        for f in set(frames):
            total[f] = total.get(f, 0) + c
    rank = lambda d: [[k, v] for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]]  # noqa: E731
    return {"samples": n, "self": rank(own), "total": rank(total)}


def report(results: list[dict], wall: float, cpu: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in results if "error" not in r]
    out_tok = sum(r["out"] for r in ok)
    in_tok = sum(r["in"] for r in ok)
    ttft = [r["ttft"] * 1e3 for r in ok]
    tpot = [r["tpot"] * 1e3 for r in ok if r["tpot"] is not None]
    rnd = lambda x: None if x is None else round(x, 3)  # noqa: E731
    return {
        "requests": len(results), "errors": len(results) - len(ok),
        "first_error": next((r["error"] for r in results if "error" in r), None),
        "duration_s": round(wall, 3), "req_s": round(len(ok) / wall, 3),
        "output_tok_s": round(out_tok / wall, 2), "total_tok_s": round((out_tok + in_tok) / wall, 2),
        "ttft_ms_p50": rnd(percentile(ttft, 50)), "ttft_ms_p99": rnd(percentile(ttft, 99)),
        "tpot_ms_p50": rnd(percentile(tpot, 50)), "tpot_ms_p99": rnd(percentile(tpot, 99)),
        # with --penalised-fraction: the rows with penalties and those without, apart
        "penalised_requests": sum(1 for r in ok if r.get("penalised")),
        "tpot_ms_p50_penalised": rnd(percentile([r["tpot"] * 1e3 for r in ok if r.get("penalised")
                                                 and r["tpot"] is not None], 50)),
        "tpot_ms_p50_plain": rnd(percentile([r["tpot"] * 1e3 for r in ok if not r.get("penalised")
                                             and r["tpot"] is not None], 50)),
        # The whole process tree: the agent, the worker and every other descendant.
        "cpu_cores_agent": round(cpu["agent"] / wall, 3), "cpu_cores_worker": round(cpu["worker"] / wall, 3),
        "cpu_cores_children": round(cpu.get("children", 0.0) / wall, 3),
        "cpu_cores": round(sum(cpu.values()) / wall, 3),
    }


def _admin_status(url: str, token: str) -> dict:
    import urllib.request

    req = urllib.request.Request(url + "/admin/v1/status", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def prepare_agent(args: argparse.Namespace, root: Path, warm_tier_bytes: str = "0") -> tuple[Path, int, str, str]:
    """Seed a store with the model (``--model-dir`` or a generated ``--arch/--preset``) and write a
    config that preloads it; returns (config path, port, model name, admin token)."""
    from agent.commands.demo import _pick_port, seed_store

    name = "bench-" + (Path(args.model_dir).name.lower() if args.model_dir else f"{args.arch}-{args.preset}")
    if args.model_dir:
        from cache.store import open_store
        from cache.publish import publish_model

        store_url = (root / "store").as_uri()
        store = open_store(store_url)
        publish_model(store, args.model_dir, name)
        store.close()
    else:
        store_url = seed_store(root, name, args.arch, args.preset)
    port = _pick_port(18080)
    token = "bench-token"
    cfg = root / "agent.toml"
    cfg.write_text(
        f'[server]\nport = {port}\nruntime_dir = "{root / "run"}"\nadmin_token = "{token}"\n\n'
        f'[store]\nurl = "{store_url}"\n\n[cache]\ndir = "{root / "cache"}"\n\n'
        f'[gpu]\ndevice = "{args.device}"\nwarm_tier_bytes = "{warm_tier_bytes}"\n\n'
        f'[[models]]\nname = "{name}"\npreload = true\nmax_model_len = {args.max_model_len}\n'
        f'max_num_seqs = {args.max_num_seqs}\n'
        + (f'quantization = "{q}"\n' if (q := getattr(args, "quantization", "none")) != "none" else "")
        + (f'kv_cache_dtype = "{kv}"\n' if (kv := getattr(args, "kv_cache_dtype", "auto")) != "auto" else "")
        + (f'\n[engine]\ndecode_step_tokens = {dst}\n' if (dst := getattr(args, "decode_step_tokens", None)) else "")
    )
    return cfg, port, name, token


@contextlib.contextmanager
def started_agent(args: argparse.Namespace, prefix: str) -> Iterator[tuple[Any, str, str, str]]:
    """A daemon in a temporary folder (a store seeded with the model of ``args``, see
    :func:`prepare_agent`), ready: (process, url, model name, admin token); stopped and its folder
    removed at the end."""
    from agent.commands.demo import start_daemon, wait_ready

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        root = Path(tmp)
        cfg, port, name, token = prepare_agent(args, root)
        proc = start_daemon(root, cfg)
        try:
            wait_ready(cfg, name, proc, 1800, root / "agent.log")
            yield proc, f"http://127.0.0.1:{port}", name, token
        finally:
            proc.terminate()
            proc.wait(60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running agent (default: start one)")
    ap.add_argument("--model", help="model name on --url")
    ap.add_argument("--admin-token", default=os.environ.get("INFIRE_ADMIN_TOKEN", ""), help="for pids and vocab")
    ap.add_argument("--api-key", default="")
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--model-dir", help="serve this model folder instead of a generated one")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-model-len", type=int, default=2048 + 16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--quantization", choices=["none", "fp8"], default="none", help="the started agent's model setting")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="the started agent's model setting")
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, help="requests in flight (the docs/perf.md serving runs: 200)")
    ap.add_argument("--rate", type=float, help="arrivals per second (inf: all at once)")
    ap.add_argument("--vocab-size", type=int, help="default: the model's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--penalised-fraction", type=float, default=0.0,
                    help="share of requests (seeded) with presence, frequency and repetition penalties, 0..1")
    ap.add_argument("--out", help="JSON path (default: docs/perf/<date>-serve-<model>-<mode>-<commit>.json)")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--warmup-requests", type=int, help="sent before the measured window, at the same "
                    "concurrency, 32 tokens out each, then 2 s idle: the load's deferred CUDA graphs and "
                    "lazily compiled kernels are done before it (default: the concurrency; 0: none)")
    ap.add_argument("--profile", help="folder: py-spy samples of the agent and the worker over the run "
                                      "(collapsed stacks, <part>.txt, and the top functions, profile.json)")
    ap.add_argument("--scrape-gauges", type=float, default=0.0, metavar="SECONDS",
                    help="scrape the gateway protocol's gauges from /metrics this often over the window, as "
                         "the inference gateway's picker does (it polls every 0.05 s); 0: off")
    ap.add_argument("--profile-native", action="store_true", help="with --profile: C frames too (pauses the "
                                                                    "processes at each sample: slower)")
    a = ap.parse_args(argv)
    if (a.concurrency is None) == (a.rate is None):
        ap.error("give exactly one of --concurrency N or --rate R")
    if not 0.0 <= a.penalised_fraction <= 1.0:
        ap.error("--penalised-fraction is a share, 0 to 1")
    if not (a.scrape_gauges == 0 or 0.01 <= a.scrape_gauges <= 60):
        ap.error("--scrape-gauges is 0 (off) or 0.01 to 60 seconds")
    with contextlib.ExitStack() as stack:
        proc = None
        if a.url:
            url, model, token = a.url.rstrip("/"), a.model, a.admin_token
            if not model:
                ap.error("--model is needed with --url")
        else:
            proc, url, model, token = stack.enter_context(started_agent(a, "serve-bench-"))
        st = _admin_status(url, token) if token else {}
        info = next((m for m in st.get("models", []) if m["name"] == model), {})
        vocab = a.vocab_size or info.get("vocab_size")
        if not vocab:
            ap.error("--vocab-size is needed (no admin token to read it from the agent)")
        reqs = sharegpt_like(a.num_requests, vocab, a.seed)
        agent_pid, worker_pid = st.get("pid") or (proc.pid if proc else None), (st.get("worker") or {}).get("pid")
        warmup = (a.concurrency or 0) if a.warmup_requests is None else a.warmup_requests
        if warmup:  # a daemon as it serves after its first minute: one-off work out of the window
            warm = [dataclasses.replace(r, output_len=min(r.output_len, 32)) for r in sharegpt_like(warmup, vocab, a.seed + 1)]
            asyncio.run(drive(url, model, warm, a.concurrency, a.rate, a.api_key, a.seed + 1))
            time.sleep(2.0)
        spies = start_profile(Path(a.profile), {"agent": agent_pid, "worker": worker_pid},
                              a.profile_native) if a.profile else {}
        sampler = GaugeSampler(url, a.scrape_gauges).start() if a.scrape_gauges else None
        before = tree_cpu_seconds(tree_pids(agent_pid, worker_pid))
        results, wall = asyncio.run(drive(url, model, reqs, a.concurrency, a.rate, a.api_key, a.seed,
                                          a.penalised_fraction))
        cpu = tree_cpu_delta(before, tree_cpu_seconds(tree_pids(agent_pid, worker_pid)))
        gauges = None
        if sampler is not None:
            sampler.stop()
            time.sleep(1.5)  # the worker's status (what the gauges read) refreshes every 0.25 s
            gauges = sampler.summary(scrape(url))
        if spies:
            stop_profile(Path(a.profile), spies)
    if a.concurrency:
        mode = f"concurrency-{a.concurrency}"
    else:
        mode = "rate-inf" if a.rate == float("inf") else f"rate-{a.rate:g}"
    now = dt.datetime.now(dt.timezone.utc)
    commit = _commit()
    device = (st.get("worker") or {}).get("device") or a.device
    result = {
        "date": now.isoformat(timespec="seconds"), "gpu": device if "cuda" in str(device) else f"none ({device})",
        "commit": commit, "command": "python -m ops.bench.serve_bench " + shlex.join(argv or sys.argv[1:]),
        "model": model, "workload": {"name": WORKLOAD, **summary(reqs), "seed": a.seed, "vocab_size": vocab},
        "mode": mode, "warmup_requests": warmup, "quantization": a.quantization, "kv_cache_dtype": a.kv_cache_dtype,
        **report(results, wall, cpu),
        # with --scrape-gauges: the node's protocol gauges over the window and after it
        "gateway_gauges": gauges,
    }
    if a.no_save:
        print(json.dumps(result, indent=2))
    else:
        save_result(result, a.out, f"{now:%Y%m%d-%H%M}-serve-{model}-{mode}-{commit}")
    return 0 if result["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())

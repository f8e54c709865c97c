"""Startup benchmark: ``infire-agent serve`` from exec to /livez 200, /readyz 200 and the first token.

Starts a daemon the way ``serve_bench`` does (a file store seeded with the model, a config that
preloads it), measures from just before the exec: /livez 200 (listening), /readyz 200 (the model
ready) and the answer to a 1-token completion sent at ready (its first token). Then SIGTERM and
``serve`` again with the same config, ``--restarts`` times: the model is in the disk cache and
Triton's compiled kernels are kept under the cache dir, as for an operator's restart. Each start's
per-phase record (admin status ``startup``, agent/startup.py) goes in the JSON beside the figures.

    python -m ops.bench.startup_bench --arch llama --preset tiny --device cpu --restarts 1
    python -m ops.bench.startup_bench --model-dir /models/llama-8b --restarts 3 --warm-tier-bytes 40GiB

The probes poll every ``POLL_S``: the figures are that much coarse at most.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from ops.bench.engine_bench import _commit, save_result
from ops.bench.serve_bench import _admin_status, prepare_agent

POLL_S = 0.01
STOP_TIMEOUT_S = 120.0


def _status_code(url: str) -> int | None:
    """The HTTP status of a GET (None while nothing answers)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def _until(url: str, proc: Any, t0: float, deadline: float, log: Path) -> float:
    """Seconds from ``t0`` until ``url`` answers 200."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise RuntimeError(f"the daemon exited with code {proc.returncode}; its log ends:\n{tail}")
        if _status_code(url) == 200:
            return time.monotonic() - t0
        time.sleep(POLL_S)
    raise TimeoutError(f"{url} did not answer 200 in time (see {log})")


def _one_token(base: str, model: str) -> None:
    """A 1-token completion; returns once its answer (the first token) is in."""
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1, "ignore_eos": True,
                       "temperature": 0.0}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        answer = json.loads(r.read())
    if answer.get("usage", {}).get("completion_tokens") != 1:
        raise RuntimeError(f"the 1-token completion did not make one token: {answer}")


def measure_start(root: Path, cfg: Path, base: str, model: str, token: str, timeout: float) -> dict[str, Any]:
    """One start: exec → /livez, /readyz, first token; the agent's own record; then SIGTERM."""
    from agent.commands.demo import start_daemon

    log = root / "agent.log"
    t0 = time.monotonic()
    proc = start_daemon(root, cfg)
    try:
        deadline = t0 + timeout
        livez = _until(base + "/livez", proc, t0, deadline, log)
        readyz = _until(base + "/readyz", proc, t0, deadline, log)
        _one_token(base, model)
        first_token = time.monotonic() - t0
        st = _admin_status(base, token)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except Exception:
            proc.kill()
            proc.wait()
    record = st.get("startup") or {}
    return {"livez_s": round(livez, 3), "readyz_s": round(readyz, 3), "first_token_s": round(first_token, 3),
            "agent_ready_s": record.get("ready_s"), "device": (st.get("worker") or {}).get("device"),
            "exit_code": proc.returncode, "phases": record.get("phases", [])}


def summarize(starts: list[dict[str, Any]]) -> dict[str, Any]:
    """The headline figures of a first start and its restarts (the worst restart: the bar)."""
    first, restarts = starts[0], starts[1:]
    ready = [s["readyz_s"] for s in restarts]
    token = [s["first_token_s"] for s in restarts]
    return {
        "first_start_to_ready_s": first["readyz_s"], "first_token_after_start_s": first["first_token_s"],
        "restart_to_ready_s": ready, "restart_to_ready_s_worst": max(ready) if ready else None,
        "first_token_after_restart_s": token, "first_token_after_restart_s_worst": max(token) if token else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--model-dir", help="serve this model folder instead of a generated one")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--restarts", type=int, default=3, help="SIGTERM and serve again this many times")
    ap.add_argument("--warm-tier-bytes", default="0", help="gpu.warm_tier_bytes of the daemon (e.g. 40GiB)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one start may take to the first token")
    ap.add_argument("--out", help="JSON path (default: docs/perf/<date>-startup-<model>-<commit>.json)")
    ap.add_argument("--no-save", action="store_true")
    a = ap.parse_args(argv)
    if a.restarts < 0:
        ap.error("--restarts must be 0 or more")
    with tempfile.TemporaryDirectory(prefix="startup-bench-") as tmp:
        root = Path(tmp)
        cfg, port, model, token = prepare_agent(a, root, a.warm_tier_bytes)
        base = f"http://127.0.0.1:{port}"
        starts = []
        for i in range(1 + a.restarts):
            starts.append({"start": "first" if i == 0 else "restart", **measure_start(root, cfg, base, model, token,
                                                                                       a.timeout)})
    now = dt.datetime.now(dt.timezone.utc)
    commit = _commit()
    device = starts[0]["device"] or a.device
    result = {
        "date": now.isoformat(timespec="seconds"), "gpu": device if "cuda" in str(device) else f"none ({device})",
        "commit": commit, "command": "python -m ops.bench.startup_bench " + shlex.join(argv or sys.argv[1:]),
        "model": model, "mode": "startup", "warm_tier_bytes": a.warm_tier_bytes, "restarts": a.restarts,
        **summarize(starts), "starts": starts,
    }
    if a.no_save:
        print(json.dumps(result, indent=2))
    else:
        save_result(result, a.out, f"{now:%Y%m%d-%H%M}-startup-{model}-{commit}")
    return 0 if all(s["exit_code"] == 0 for s in starts) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""The density benchmark runs end to end on CPU: the real daemon with three tiny models published
under three names, a few seconds of Poisson traffic, and a JSON report with every key the GPU runs
are read by; its load/unload cycle drill under traffic; its OOM drill refused without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.sampling import SamplingParams
from ops.bench.density_bench import arrivals, main, unavailable_during_replacement, unexpected_errors, zipf_weights
from tests.integration.agent_harness import REPO


def test_traffic_shape_is_seeded_and_follows_the_popularity() -> None:
    assert zipf_weights(3, 0) == pytest.approx([1 / 3] * 3)
    w = zipf_weights(4, 1.0)
    assert sum(w) == pytest.approx(1.0) and w[0] > w[1] > w[2] > w[3] and w[0] / w[1] == pytest.approx(2.0)
    a = arrivals([5.0, 1.0], 20.0, seed=3)
    assert a == arrivals([5.0, 1.0], 20.0, seed=3) and a == sorted(a)
    assert all(0 <= t < 20.0 for t, _ in a)
    n0, n1 = sum(m == 0 for _, m in a), sum(m == 1 for _, m in a)
    assert 60 < n0 < 140 and 5 < n1 < 40


def _bench(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    """The bench on CPU (tiny models, 16 in / 8 out, 2 req/s each) with ``args``: its run and its JSON."""
    out = tmp_path / "density.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "INFIRE_ENGINE__SANDBOX": "false", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "ops.bench.density_bench", "--device", "cpu", "--prompt-len", "16",
                        "--gen-len", "8", "--rate-per-model", "2", "--max-num-seqs", "8", "--out", str(out), *args],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r, json.loads(out.read_text())


@pytest.mark.slow
def test_only_the_errors_a_drill_causes_by_design_are_forgiven() -> None:
    """The SIGSTOP drill ends the requests on the hung worker with worker_died, and a request
    arriving while it is replaced gets 503 engine_unavailable: that is what it checks, so a run
    with it exits 0 on those alone; any other error, or those without the drill, still fails
    the run."""
    died = {"stream:worker_died": 43, "http_503:engine_unavailable": 2}
    drill = {"at_s": 100.0, "replaced_after_s": 13.0}
    sent = [{"error": "http_503:engine_unavailable", "sent_s": 105.0}, {"error": "http_503:engine_unavailable",
                                                                        "sent_s": 20.0}, {"sent_s": 106.0}]
    during = unavailable_during_replacement(sent, drill)
    assert during == 1  # the one sent at 20 s was not the drill's
    assert unexpected_errors({"errors_by_kind": died, "drill_sigstop": drill, "unavailable_during_replacement": 2}) == 0
    assert unexpected_errors({"errors_by_kind": died, "drill_sigstop": drill, "unavailable_during_replacement": during}) == 1
    assert unexpected_errors({"errors_by_kind": died, "drill_sigstop": None}) == 45
    assert unexpected_errors({"errors_by_kind": {**died, "http_503:no_room": 2}, "drill_sigstop": drill,
                              "unavailable_during_replacement": 2}) == 2


def test_density_bench_runs_against_a_real_daemon(tmp_path) -> None:
    r, rep = _bench(tmp_path, "--models", "3", "--duration", "4", "--warm-tier-bytes", "64MiB")
    # the window starts once the warm tier is ready whole (off CUDA: at once, nothing to pin)
    assert rep["warm_tier_at_start"]["budget"] == rep["warm_tier_at_start"]["ready"] == 64 << 20, rep
    assert 0 <= rep["warm_tier_wait_s"] < 60
    for key in ("date", "gpu", "commit", "command", "models", "errors", "worker_restarts", "nvml_peak_bytes",
                "budget_bytes", "max_resident", "swaps", "evictions", "overall", "per_model"):
        assert key in rep, key
    assert rep["models"] == 3 and rep["errors"] == 0 and rep["worker_restarts"] == 0
    assert rep["requests"] > 0 and rep["nvml_peak_bytes"] is None  # no GPU: no NVML figure
    assert rep["budget_bytes"] > 0 and 1 <= rep["max_resident"] <= 3
    # who held the budget at the highest residency: the models' weights and workspaces, the pool
    held = rep["max_resident_budget"]
    assert held["total_bytes"] == rep["budget_bytes"] and held["weights_bytes"] > 0 and held["kv_pool_bytes"] > 0, held
    assert held["weights_bytes"] + held["workspace_bytes"] + held["step_bytes"] + held["vacant_bytes"] + held["kv_pool_bytes"] \
        + held["untracked_bytes"] == held["used_bytes"], held
    assert set(rep["per_model"]) == {"d00", "d01", "d02"}
    assert sum(m["requests"] for m in rep["per_model"].values()) == rep["requests"]
    o = rep["overall"]
    assert o["ok"] == o["requests"] and 0 < o["ttft_ms_p50"] <= o["ttft_ms_p99"]
    assert o["tpot_ms_p50"] > 0 and 0 <= o["slo_ttft_1s"] <= 1 and o["output_tokens"] == 8 * o["requests"]
    assert any(line.lstrip().startswith("overall") for line in r.stdout.splitlines()[-6:])  # the table, last


@pytest.mark.slow
def test_cycle_drill_loads_and_unloads_two_models_in_turn_under_traffic(tmp_path) -> None:
    r, rep = _bench(tmp_path, "--models", "2", "--duration", "5", "--drill-cycles", "4", "--drill-cycles-at", "0.5")
    c = rep["drill_cycles"]
    assert c["cycles"] == c["done"] == c["ok"] == 4 and c["failures"] == [], c
    assert [x["model"] for x in c["per_cycle"]] == ["cyc8", "cycb", "cyc8", "cycb"]
    for x in c["per_cycle"]:
        assert x["load"]["status"] == 200 and x["load"]["state"] == "ready", x
        assert x["unload"]["status"] == 200 and x["unload"]["state"] in ("cached", "absent"), x
    assert c["cyc8"] == "plain" and 0 < c["load_s_p50"] <= c["load_s_max"] and c["unload_s_p50"] > 0
    # where the window's loads went: each cycle's load, its phases and the engine's own timings
    b = rep["load_breakdown"]
    assert b["count"] >= 4 and {"cyc8", "cycb"} <= {x[0] for x in b["loads"]}, b
    assert {"room", "load", "canary"} <= set(b["phases_p50"]) and "total_s" in b["engine_p50"], b
    assert 0 < b["phases_p50"]["load"] and b["seconds_p50"] > 0
    v = b["vacancy"]  # loads into an unloaded model's tensors (engine/core/vacancy.py), and the rest
    assert v["taken"]["count"] + v["fresh"]["count"] == b["count"] and v["fresh"]["engine_total_p50"] > 0, v
    assert isinstance(rep["pool_resizes"], int) and rep["pool_resizes"] >= 0 and rep["pool_resize_s"] >= 0
    assert rep["room_waits"] == 0  # the budget holds every model here
    ledger = rep["swap_ledger"]  # each cycle model loaded (at least) twice, nothing drained for room here
    assert all(ledger["per_model"][m]["loads"] >= 2 and ledger["per_model"][m]["drains"] == 0 for m in ("cyc8", "cycb"))
    assert {"loading", "unloading"} <= set(ledger["state_s"]) and ledger["state_s"]["loading"]["p50"] > 0
    assert rep["worker_restarts"] == 0 and rep["errors"] == 0 and rep["drill_oom"] is None
    assert set(rep["per_model"]) == {"d00", "d01"} and all(m["errors"] == 0 for m in rep["per_model"].values())
    assert any(line.startswith("drill_cycles: ") and "per_cycle" not in line for line in r.stdout.splitlines())


def test_oom_drill_is_refused_on_cpu(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--device", "cpu", "--rate-per-model", "1", "--drill-oom-at", "5"])
    assert e.value.code == 2 and "--drill-oom-at" in capsys.readouterr().err


async def test_distinct_names_share_the_shards_on_disk_and_are_different_models_to_the_engine(
        tmp_path, make_tiny_model) -> None:
    """``--distinct``: every name its own files, as distinct models of one size would be, while
    the store and the disk cache keep the shards once. The warm tier keys a model's device bytes
    by its files, so the names no longer share one warm copy (the bench's figures then model a
    node of different models); the weights loaded are the source's, the tag tensor passed over."""
    from cache.disk_cache import DiskCache
    from cache.file_store import FileStore
    from engine.weights.loader import warm_key
    from ops.bench.density_bench import TAG_FILE, publish_distinct
    from tests.engine_run import cpu_core
    from tests.s3_fault_proxy import fast_download

    src = make_tiny_model("llama")
    store = FileStore(tmp_path / "store")
    publish_distinct(store, src, ["d00", "d01", "d02"], tmp_path / "work")
    cache = DiskCache(tmp_path / "cache", 1 << 30, download=fast_download())
    snaps = [await cache.pull(store, n) for n in ("d00", "d01", "d02")]
    assert os.path.samefile(snaps[0] / "model.safetensors", snaps[2] / "model.safetensors")  # one blob
    assert not os.path.samefile(snaps[0] / TAG_FILE, snaps[1] / TAG_FILE)
    assert len({warm_key(s) for s in snaps}) == 3  # three models to the warm tier
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    answers = []
    for d in (src, *snaps):
        core = cpu_core(d)
        core.add_request("r", "m", [3, 1, 4, 1, 5], params)
        got = []
        while core.has_unfinished_requests():
            got += [t for o in core.step() for t in o.new_token_ids]
        answers.append(got)
    assert all(a == answers[0] for a in answers) and len(answers[0]) == 6


def test_distinct_names_are_refused_with_fp8_weights(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--distinct", "--quantization", "fp8", "--rate", "1", "--device", "cpu"])
    assert "--distinct with --quantization fp8" in capsys.readouterr().err


def test_pool_resizes_are_summed_over_worker_restarts() -> None:
    """A worker replaced mid-run (the SIGSTOP drill) counts its resizes from 0 again: the window's
    figure sums each worker's last count, so it never goes negative (it read -1 on the H200)."""
    import argparse
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from ops.bench.density_bench import Monitor

    answers = iter([(11, 3, 0.6), (11, 4, 0.9), (12, 0, 0.0), (12, 2, 0.5)])  # (worker pid, resizes, seconds)

    class Status(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the handler's name
            pid, n, s = next(answers)
            body = json.dumps({"models": [], "worker": {"pid": pid},
                               "budget": {"pool_resizes": n, "pool_resize_s": s}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Status)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        m = Monitor(f"http://127.0.0.1:{server.server_address[1]}", 0, False, argparse.Namespace())
        seen = []
        for _ in range(4):
            m.poll()
            seen.append(m.pool_resizes_now)
    finally:
        server.shutdown()
    assert [n for n, _ in seen] == [3, 4, 4, 6]
    assert seen[-1][1] == pytest.approx(1.4)

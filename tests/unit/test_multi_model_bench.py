"""The multi-model bench runs end to end on tiny CPU models and reports every phase."""

from __future__ import annotations

import json

from ops.bench import multi_model_bench


def test_bench_runs_on_tiny_models(tmp_path):
    out = tmp_path / "mm.json"
    argv = ["--device", "cpu", "--work", str(tmp_path / "models"), "--num-requests", "3", "--gen-len", "4",
            "--flood", "3", "--trickle", "2", "--warmup-requests", "1", "--max-num-seqs", "4", "--out", str(out)]
    assert multi_model_bench.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["refusal"]["refused"] and res["refusal"]["plan_evict"] == ["A"]
    assert res["refusal"]["needed"] == res["needs_bytes"]["C"]
    assert res["throughput"]["together"]["output_tok_s"] > 0 and len(res["ttft"]["flooded_s"]) == 2
    assert set(res["swap"]) >= {"unload_A_s", "load_C_s", "reload_A_s"}
    assert res["memory"]["kv_used"] == 0 and set(res["memory"]["models"]) == {"A", "B"}

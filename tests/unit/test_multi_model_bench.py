"""The multi-model bench runs end to end on tiny CPU models and reports every phase and goal."""

from __future__ import annotations

import json
from types import SimpleNamespace

from ops.bench import multi_model_bench
from ops.bench.multi_model_phases import Tracker
from ops.bench.multi_model_summary import goals


def _out(rid, n=1, reason=None):
    return SimpleNamespace(req_id=rid, new_token_ids=[7] * n, finish_reason=reason)


def test_tracker_counts_the_window_and_time_in_flight():
    tr = Tracker(window=(1.0, 3.0))
    tr.t0 -= 10  # "now" is far past every time below; only the times passed in count
    tr.sent("a", "A", 0.0, prompt_len=5)
    tr.sent("b", "A", 1.5, prompt_len=7)
    tr.tick(0.0)
    tr.take([_out("a")], 0.5)  # first token before the window: its prompt is not counted
    tr.tick(2.0)  # both were live from the last tick to this one: 2 requests x 2 s
    tr.take([_out("a", 2, "length"), _out("b")], 2.0)
    tr.take([_out("b", 1, "length"), _out("stranger")], 3.5)  # after the window; unknown ids ignored
    assert tr.tokens["A"] == 5 and tr.window_tokens["A"] == 3 and tr.window_prompt_tokens["A"] == 7
    assert not tr.live["A"] and tr.reason == {"a": "length", "b": "length"}
    assert tr.in_flight_s["A"] == 4.0
    lat = tr.latency("A")
    assert lat["ttft_ms_p50"] == lat["ttft_ms_p99"] == 500.0  # both from when they were due
    assert lat["tpot_ms_p50"] == 750.0 and lat["tpot_ms_p99"] == 1500.0  # a: 1.5 s / 2, b: 1.5 s / 1


def test_goals_from_a_result():
    res = {"saturated": {"together_vs_alone": 0.95},
           "light": {"together_vs_solo": {"A": {"delivered": 0.97}, "B": {"delivered": 0.5}}},
           "ttft": {"flooded_by": {"128": {"ratio_p50": 1.5}, "512": {"ratio_p50": 2.5}}},
           "swap": {"warm_tier": {"total_s": 0.7, "load_A": {"from": "files"}}}}
    g = goals(res)
    assert g["saturated_together_vs_alone"]["met"] and g["light_A_together_vs_solo"]["met"]
    assert g["light_B_together_vs_solo"]["met"] is False and g["ttft_flood_512_vs_solo"]["met"] is False
    assert g["ttft_flood_128_vs_solo"]["met"] and "not the warm tier" in g["swap_from_warm_tier_s"]["note"]


def test_bench_runs_on_tiny_models(tmp_path, make_tiny_model, capsys):
    a, b = make_tiny_model("llama", seed=0), make_tiny_model("llama", seed=1)
    c = make_tiny_model("qwen3")
    out = tmp_path / "mm.json"
    argv = ["--device", "cpu", "--big", str(a), str(b), "--small", str(c), "--max-model-len", "256",
            "--max-num-seqs", "4", "--max-num-batched-tokens", "256", "--decode-buckets", "1", "2", "4",
            "--warmup-requests", "2", "--num-requests", "8", "--sat-duration", "1.0", "--sat-ramp", "0.2",
            "--prompt-len", "16", "--gen-len", "6", "--light-rate", "8", "--light-duration", "1.0",
            "--light-ramp", "0.2", "--flood", "3", "--trickle", "2", "--ttft-interval", "0.05",
            "--ttft-lead", "0.1", "--warm-tier-bytes", str(64 << 20), "--out", str(out)]
    assert multi_model_bench.main(argv) == 0
    text = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert {"command", "date", "commit", "settings", "plan", "goals"} <= set(res)
    assert "--sat-duration" in res["command"] and "multi-model bench" in text and "together / alone" in text

    p = res["plan"]  # A and B (with their reserved KV) fit the budget, C beside them does not
    assert p["needs"]["A"] + p["needs"]["B"] <= p["budget"] < p["needs"]["A"] + p["needs"]["B"] + p["needs"]["C"]
    assert res["load"]["A"]["kv_pages"] == res["load"]["B"]["kv_pages"] == p["kv_pages"]
    assert p["kv_tokens_per_big_model"] >= 4 * 256  # default: max_num_seqs longest sequences
    assert res["refusal"]["refused"] and res["refusal"]["plan_evict"] == ["A"]
    assert res["refusal"]["needed"] == p["needs"]["C"]
    assert res["warm_up"]["buckets"] == [1, 2, 4] and res["warm_up"]["requests"] == 4

    sat = res["saturated"]
    for k in ("A_alone", "B_alone", "together"):
        assert sat[k]["total_tok_s"] > sat[k]["output_tok_s"] > 0 and sat[k]["engine"]["steps"] > 0
    assert set(sat["together"]["per_model"]) == {"A", "B"} and sat["together_vs_alone"] > 0
    assert sat["A_alone"]["engine"]["per_model"]["B"]["steps"] == 0

    li = res["light"]  # the same seeded schedule solo and together
    for m in ("A", "B"):
        solo, both = li[f"{m}_solo"]["per_model"][m], li["together"]["per_model"][m]
        assert solo["arrived"] == both["arrived"] > 0 and solo["offered_tok_s"] == both["offered_tok_s"]
        assert solo["delivered_tok_s"] > 0 and li["together_vs_solo"][m]["delivered"] > 0
    assert set(res["goals"]) >= {"light_A_together_vs_solo", "light_B_together_vs_solo",
                                 "saturated_together_vs_alone", "ttft_flood_3_vs_solo", "swap_from_warm_tier_s"}

    tt = res["ttft"]
    assert len(tt["solo"]["ttft_ms"]) == 2 and len(tt["flooded_by"]["3"]["ttft_ms"]) == 2
    assert not tt["flooded_by"]["3"]["timed_out"] and tt["flooded_by"]["3"]["flood"]["added"] >= 3
    assert tt["flooded_by"]["3"]["flood_alone"]["output_tok_s"] > 0  # the flood's rate without the trickle
    assert tt["flooded_by"]["3"]["flood_tok_s_vs_alone"] > 0

    sw = res["swap"]
    assert sw["warm_tier"]["load_A"]["from"] == "warm_tier" and sw["page_cache"]["load_A"]["from"] == "files"
    assert sw["to_small"]["load_C"]["s"] > 0
    assert res["memory"]["kv_used"] == 0 and set(res["memory"]["models"]) == {"A", "B"}

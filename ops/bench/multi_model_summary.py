"""The multi-model bench's goal checks (issue 7) and its text summary; both read only the JSON result."""

from __future__ import annotations

from typing import Any

GIB = 1 << 30


def _goal(value: float | None, op: str, target: float, note: str = "") -> dict[str, Any]:
    met = None if value is None else (value <= target if op == "<=" else value >= target)
    return {"value": value, "goal": f"{op} {target}", "met": met, **({"note": note} if note else {})}


def goals(res: dict[str, Any]) -> dict[str, Any]:
    """Each goal of the issue with the figure it is judged on (absent phases are left out)."""
    g: dict[str, Any] = {}
    sw = res.get("swap")
    if sw:
        warm = sw["warm_tier"]
        src = warm["load_A"]["from"]
        g["swap_from_warm_tier_s"] = _goal(warm["total_s"], "<=", 1.0, "unload C + load A" + (
            "" if src == "warm_tier" else f"; A came from {src}, not the warm tier"))
    sat = res.get("saturated")
    if sat:
        g["saturated_together_vs_alone"] = _goal(sat["together_vs_alone"], ">=", 0.9,
                                                 "total tok/s together / mean alone")
    light = res.get("light")
    if light:
        for m, r in light["together_vs_solo"].items():
            g[f"light_{m}_together_vs_solo"] = _goal(r["delivered"], ">=", 0.9, "delivered output tok/s")
    ttft = res.get("ttft")
    if ttft:
        for n, f in ttft["flooded_by"].items():
            g[f"ttft_flood_{n}_vs_solo"] = _goal(f["ratio_p50"], "<=", 2.0, "median TTFT flooded / solo")
    return g


def _b(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.2f} MiB"


def _f(x: float | None, fmt: str = ",.0f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _eng(ph: dict[str, Any]) -> str:
    """'A 812 steps (640 graph, host 0.7 ms), B ...; 9.1 ms per engine step, 1,700 calls'."""
    e = ph["engine"]
    parts = [f"{m} {p['steps']:,} steps ({p['graph_steps']:,} graph, host {_f(p['host_ms_per_step'], '.1f')} ms)"
             for m, p in e["per_model"].items() if p["steps"]]
    return f"{'; '.join(parts)}; {_f(e['wall_ms_per_step'], '.1f')} ms wall per engine step, {ph['step_calls']:,} calls"


def _met(g: dict[str, Any] | None) -> str:
    if not g:
        return ""
    return f" (goal {g['goal']}: {'met' if g['met'] else 'NOT met' if g['met'] is False else 'n/a'})"


def summary(res: dict[str, Any]) -> str:
    s = res["settings"]
    p = res["plan"]
    g = res.get("goals", {})
    L = [f"multi-model bench  {res['date']}  commit {res['commit']}  {res['gpu']}",
         (f"steps: {s['max_num_batched_tokens']} tokens / {s['max_num_seqs']} seqs, max_model_len "
         f"{s['max_model_len']}; budget {_b(p['budget'])} = A {_b(p['needs']['A'])} + B {_b(p['needs']['B'])} "
         f"(each with {p['kv_pages']:,} KV pages = {_b(p['kv_bytes_per_big_model'])}, "
         f"{p['kv_tokens_per_big_model']:,} tokens) + C/2 {_b(p['needs']['C'] / 2)}"),
         (f"load: A {res['load']['A']['s']:.2f} s, B {res['load']['B']['s']:.2f} s; warm-up "
         f"{res['warm_up']['s']:.1f} s (buckets {res['warm_up']['buckets']})")]
    r = res["refusal"]
    L.append(f"C beside A+B: refused, needed {r['needed']:,} B, free {r['free']:,} B, plan evicts {r['plan_evict']}"
             if r["refused"] else "C beside A+B: NOT refused (budget holds all three)")
    sat = res.get("saturated")
    if sat:
        how = (f"{sat['in_flight_per_model']} in flight per model for {sat['duration_s']} s, counted "
               f"{sat['window_s'][0]}-{sat['window_s'][1]} s" if sat["mode"] == "steady" else
               f"{sat['distinct_requests_per_model']['A']} req/model at t0, to the end")
        L.append(f"saturated ({sat['workload']}, {how}):")
        for k in ("A_alone", "B_alone", "together"):
            ph = sat[k]
            L.append(f"  {k:9s} {_f(ph['total_tok_s'])} total tok/s ({_f(ph['output_tok_s'])} out); {_eng(ph)}")
        L.append(f"  together / alone = {sat['together_vs_alone']:.2f}{_met(g.get('saturated_together_vs_alone'))}")
    li = res.get("light")
    if li:
        L.append(f"light ({li['rate_per_model_req_s']} req/s/model {li['arrivals']}, {li['prompt_len']}->"
                 f"{li['gen_len']} tokens, {li['duration_s']} s, counted {li['window_s'][0]}-{li['window_s'][1]} s):")
        for m in ("A", "B"):
            so, to = li[f"{m}_solo"]["per_model"][m], li["together"]["per_model"][m]
            rt = li["together_vs_solo"][m]
            L.append(f"  {m}: solo {_f(so['delivered_tok_s'])} tok/s, TPOT p50 {_f(so['tpot_ms_p50'], '.1f')} ms, "
                     f"TTFT p50 {_f(so['ttft_ms_p50'], '.1f')} ms, {so['mean_in_flight']:.1f} in flight | together "
                     f"{_f(to['delivered_tok_s'])} tok/s = {_f(rt['delivered'], '.2f')}{_met(g.get(f'light_{m}_together_vs_solo'))},"
                     f" TPOT {_f(to['tpot_ms_p50'], '.1f')} ms ({_f(rt['tpot_p50'], '.2f')}x), TTFT "
                     f"{_f(to['ttft_ms_p50'], '.1f')} ms ({_f(rt['ttft_p50'], '.2f')}x)")
    tt = res.get("ttft")
    if tt:
        L.append(f"TTFT of quiet B ({tt['prompt_len']}-token prompt): solo p50 {_f(tt['solo']['p50_ms'], '.1f')} ms, "
                 f"p90 {_f(tt['solo']['p90_ms'], '.1f')}")
        for n, f in tt["flooded_by"].items():
            fl = f["flood"]
            cost = f" = {_f(f['flood_tok_s_vs_alone'], '.2f')}x its rate alone" if "flood_tok_s_vs_alone" in f else ""
            L.append(f"  A flooded at {n} in flight ({_f(fl['output_tok_s'])} out tok/s{cost}): p50 {_f(f['p50_ms'], '.1f')}"
                     f" ms, p90 {_f(f['p90_ms'], '.1f')} = {_f(f['ratio_p50'], '.2f')}x solo{_met(g.get(f'ttft_flood_{n}_vs_solo'))}")
    sw = res.get("swap")
    if sw:
        ts, w, pc = sw["to_small"], sw["warm_tier"], sw["page_cache"]
        L.append(f"swap: A out {ts['unload_A_s']:.2f} s (into the warm tier: {sw['warm_tier_bytes'] > 0}) + C in "
                 f"{ts['load_C']['s']:.2f} s")
        L.append(f"  C out {w['unload_C_s']:.2f} s + A in {w['load_A']['s']:.2f} s from {w['load_A']['from']} = "
                 f"{w['total_s']:.2f} s{_met(g.get('swap_from_warm_tier_s'))}")
        L.append(f"  A out {pc['unload_A_s']:.2f} s + A in {pc['load_A']['s']:.2f} s from files (page cache) = "
                 f"{pc['total_s']:.2f} s")
    return "\n".join(L)

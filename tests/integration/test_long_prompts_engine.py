"""More long prompts at once than the KV pool holds, beside short requests (issue 38's bad input):
they queue or are preempted and recomputed, never fail, and the short requests keep their turn.

CPU, the tiny Llama: a 1,024-token pool (64 pages of 16) for six 500-token prompts, a step
budget of 128 tokens and 48 beside decodes, so prompts are chunked, pages run out and the
scheduler's rules for steps beside decodes (engine/sched/scheduler.py) all act."""

from __future__ import annotations

from engine.core.engine_core import EngineCore
from engine.load_spec import LoadSpec
from engine.options import EngineOptions
from engine.sampling import SamplingParams

LONG, SHORT = 500, 10


def test_long_prompts_beyond_the_pool_queue_and_short_requests_keep_their_turn(make_tiny_model):
    core = EngineCore(EngineOptions(max_num_batched_tokens=128, decode_step_tokens=48, block_size=16,
                                    dtype="float32"), device="cpu")
    core.load_model(LoadSpec("m", make_tiny_model("llama"), max_model_len=512, max_num_seqs=16, num_kv_pages=64))
    want: dict[str, int] = {}
    for i in range(6):
        core.add_request(f"long{i}", "m", [1 + (i * 7 + j) % 200 for j in range(LONG)],
                         SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        want[f"long{i}"] = 8
    got: dict[str, list[int]] = {r: [] for r in want}
    ends: dict[str, str | None] = {}
    sent_at: dict[str, int] = {}
    first_at: dict[str, int] = {}
    finished_at: dict[str, int] = {}
    step = 0
    while core.has_unfinished_requests() or step < 40:
        if step < 40 and step % 2 == 0:  # a short request every other step while the long ones run
            rid = f"short{step}"
            core.add_request(rid, "m", [3 + step % 50] * SHORT, SamplingParams(temperature=0, max_tokens=4,
                                                                               ignore_eos=True))
            want[rid], got[rid], sent_at[rid] = 4, [], step
        for out in core.step():
            got[out.req_id] += out.new_token_ids
            if out.new_token_ids and out.req_id not in first_at:
                first_at[out.req_id] = step
            if out.finish_reason is not None:
                ends[out.req_id] = out.finish_reason
                finished_at[out.req_id] = step
        step += 1
        assert step < 20_000, "no progress"
    assert all(ends[r] == "length" and len(got[r]) == n for r, n in want.items()), ends
    shorts = [r for r in want if r.startswith("short")]
    last_long = max(finished_at[r] for r in want if r.startswith("long"))
    # served while the long prompts were still going: those sent while the six were being admitted
    # wait their turn behind them (first come, first admitted), most are admitted at their first
    # step (a waiting prompt keeps its room in each step, whatever the long prompts' chunks want)
    assert all(finished_at[r] < last_long for r in shorts)
    waits = sorted(first_at[r] - sent_at[r] for r in shorts)
    assert waits[-1] <= 10 and waits[len(waits) // 2] == 0, waits

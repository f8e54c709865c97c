"""Scheduler: budgets, chunked prefill, preemption by recompute, aborts, against a fake model.

The fake model writes each new token into a slot array through the block table (as the real
KV write does) and derives the next token from the tokens it *reads back* through the block
table. A page shared by two live sequences, a stale page after preemption, or a wrong position
therefore changes the output, and every schedule must give the same tokens as the reference.
"""

from __future__ import annotations

import random
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sched.block_manager import BlockManager, PageAllocator
from engine.sched.prefix_index import PrefixIndex
from engine.sampling import SamplingParams
from engine.sched.scheduler import Scheduler, SchedulerConfig, SchedulerConfigError, SchedulerOutput
from engine.sched.sequence import FinishReason, SequenceStatus

VOCAB = 50
EOS = 0


def next_token(tokens: list[int]) -> int:
    return zlib.crc32(bytes(str(tokens), "ascii")) % VOCAB


def reference(prompt: list[int], params: SamplingParams, max_model_len: int) -> tuple[list[int], str]:
    toks = list(prompt)
    out: list[int] = []
    while True:
        t = next_token(toks)
        toks.append(t)
        out.append(t)
        if (not params.ignore_eos and t == EOS) or t in params.stop_token_ids:
            return out, "stop"
        if len(out) >= params.max_tokens or len(toks) >= max_model_len:
            return out, "length"


class FakeRunner:
    def __init__(self, num_pages: int, block_size: int) -> None:
        self.bs = block_size
        self.slots: list[int | None] = [None] * (num_pages * block_size)

    def run(self, sched: Scheduler, out: SchedulerOutput) -> list[int]:
        cfg = sched.config
        assert out.num_batched_tokens == sum(s.num_tokens for s in out.seqs) <= cfg.max_num_batched_tokens
        assert len(out.seqs) <= cfg.max_num_seqs
        assert len({s.seq_id for s in out.seqs}) == len(out.seqs)
        assert all(s.num_tokens == 1 for s in out.seqs[: out.num_decodes])
        sampled = []
        for s in out.seqs:
            assert len(s.block_table) * self.bs >= s.seq_len, "pages do not cover the step"
            for j, tok in enumerate(s.token_ids):
                pos = s.start_pos + j
                self.slots[s.block_table[pos // self.bs] * self.bs + pos % self.bs] = tok
            if s.sample:
                ctx = [self.slots[s.block_table[p // self.bs] * self.bs + p % self.bs] for p in range(s.seq_len)]
                sampled.append(next_token(ctx))
        return sampled


def check_pages(sched: Scheduler, alloc: PageAllocator) -> None:
    bm = sched.blocks
    live = bm.live_sequences()
    pages = [p for sid in live for p in bm.block_table(sid)]
    assert len(pages) == len(set(pages)), "page shared by two sequences"
    assert alloc.num_free + len(pages) == alloc.num_total, "page leaked"
    running_ids = {s.seq_id for s in sched.running}
    assert set(live) <= running_ids, "a waiting or finished sequence holds pages"
    assert len(sched.running) <= sched.config.max_num_seqs
    for s in sched.running:
        assert len(bm.block_table(s.seq_id)) * bm.block_size >= s.num_computed_tokens


def make(num_pages=64, block_size=4, **cfg) -> tuple[Scheduler, PageAllocator, FakeRunner]:
    alloc = PageAllocator(num_pages)
    cfg.setdefault("eos_token_ids", (EOS,))
    cfg.setdefault("max_model_len", 64)
    sched = Scheduler(SchedulerConfig(**cfg), BlockManager(block_size, alloc))
    return sched, alloc, FakeRunner(num_pages, block_size)


def one_decoding(attention_cost: float, decode_step_tokens: int):
    """A scheduler costing chunks by ``attention_cost`` with a decode step of ``decode_step_tokens``,
    one request ("dec") already decoding: the steps beside decodes the tests below look at."""
    sched, alloc, runner = make(num_pages=400, block_size=4, max_num_batched_tokens=256, max_model_len=1024,
                                attention_cost=attention_cost, decode_step_tokens=decode_step_tokens)
    sched.add("dec", [3, 4, 5], SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
    out = sched.schedule()
    sched.update(out, runner.run(sched, out))
    return sched, alloc, runner


def drive(sched, alloc, runner, requests, abort_at=None, max_steps=10_000, check=check_pages):
    """Run to completion; returns {req_id: (tokens, reason)}; ``check``s invariants every step."""
    results: dict[str, tuple[list[int], str]] = {}
    pending = list(requests)
    step = 0
    while pending or sched.has_unfinished():
        if pending:  # trickle requests in, two per step
            for req_id, prompt, params in pending[:2]:
                sched.add(req_id, prompt, params)
                results[req_id] = ([], "")
            pending = pending[2:]
        if abort_at:
            for req_id in abort_at.get(step, []):
                seq = sched.abort(req_id)
                if seq is not None:
                    results[req_id] = (results[req_id][0], "abort")
        out = sched.schedule()
        running_arrivals = [s.arrival for s in sched.running]
        for rid in out.preempted_req_ids:  # newest first: every victim is newer than every survivor
            assert all(sched.get(rid).arrival > a for a in running_arrivals)
        sampled = runner.run(sched, out)
        for seq in sched.update(out, sampled):
            toks, _ = results[seq.req_id]
            toks.append(seq.token_ids[-1])
            if seq.finish_reason is not None:
                results[seq.req_id] = (toks, seq.finish_reason.value)
        check(sched, alloc)
        step += 1
        assert step < max_steps, "no progress"
        if not out.seqs and sched.has_unfinished() and not pending:
            raise AssertionError("scheduled nothing while requests wait")
    assert alloc.num_free == alloc.num_total
    return results


def random_requests(rng: random.Random, n: int, max_prompt: int = 20, max_tokens: int = 12):
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, max_prompt))]
        params = SamplingParams(temperature=0, max_tokens=rng.randint(1, max_tokens), ignore_eos=rng.random() < 0.5,
                                stop_token_ids=[rng.randrange(VOCAB)] if rng.random() < 0.3 else [])
        reqs.append((f"r{i}", prompt, params))
    return reqs


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    block_size=st.sampled_from([1, 2, 4, 16]),
    budget=st.integers(1, 64),
    max_num_seqs=st.integers(1, 8),
    chunk=st.sampled_from([None, 1, 3, 17]),
    spare_pages=st.integers(0, 30),
    aborts=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 7)), max_size=3),
    attention_cost=st.sampled_from([0.0, 0.02, 0.5]),
    decode_step_tokens=st.sampled_from([None, 1, 5]),
)
def test_any_schedule_gives_reference_tokens(seed, block_size, budget, max_num_seqs, chunk, spare_pages, aborts,
                                             attention_cost, decode_step_tokens):
    rng = random.Random(seed)
    max_model_len = 40
    reqs = random_requests(rng, rng.randint(1, 8))
    abort_at: dict[int, list[str]] = {}
    for step, i in aborts:
        if i < len(reqs):
            abort_at.setdefault(step, []).append(f"r{i}")
    num_pages = -(-max_model_len // block_size) + spare_pages  # tight: forces preemption often
    sched, alloc, runner = make(num_pages, block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                max_model_len=max_model_len, max_prefill_chunk=chunk, attention_cost=attention_cost,
                                decode_step_tokens=decode_step_tokens)
    results = drive(sched, alloc, runner, reqs, abort_at=abort_at)
    for req_id, prompt, params in reqs:
        want = reference(prompt, params, max_model_len)
        got = results[req_id]
        if got[1] == "abort":  # whatever came out before the abort is a prefix of the truth
            assert got[0] == want[0][: len(got[0])], req_id
        else:
            assert got == want, req_id


def test_preemption_happens_and_resumes_without_loss():
    rng = random.Random(1)
    reqs = [(f"r{i}", [rng.randrange(1, VOCAB) for _ in range(6)], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
            for i in range(4)]
    sched, alloc, runner = make(num_pages=8, block_size=4, max_model_len=32, max_num_batched_tokens=64)
    preempted: list[str] = []
    orig = sched.schedule

    def spy():
        out = orig()
        preempted.extend(out.preempted_req_ids)
        return out

    sched.schedule = spy
    results = drive(sched, alloc, runner, reqs)
    assert preempted, "the tiny page budget should force preemption"
    for req_id, prompt, params in reqs:
        assert results[req_id] == reference(prompt, params, 32)
    assert "r0" not in preempted  # the oldest is never the victim while newer ones run


def test_decodes_first_then_prefill_chunks_share_a_step():
    sched, alloc, runner = make(num_pages=64, block_size=4, max_num_batched_tokens=8, max_model_len=64)
    sched.add("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    out = sched.schedule()
    sched.update(out, runner.run(sched, out))
    sched.add("b", list(range(1, 21)), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    out = sched.schedule()
    assert [s.req_id for s in out.seqs] == ["a", "b"] and out.num_decodes == 1
    assert out.seqs[1].num_tokens == 7 and not out.seqs[1].sample  # chunk of the 20-token prompt
    sched.update(out, runner.run(sched, out))
    out = sched.schedule()
    assert out.seqs[1].start_pos == 7 and out.seqs[1].num_tokens == 7


def test_a_long_prompt_beside_decodes_is_chunked_by_its_work_not_its_tokens():
    """Every step of a long prompt's prefill beside a decoding request carries the decode, and
    costs at most the budget by work (each chunk token also attends to all before it): the chunks
    shrink as the prompt goes deeper, so the decode's steps stay as short deep in the prompt as
    at its start. Alone, the prompt takes whole budgets (nobody waits on its steps), and the
    tokens are the reference's either way."""
    a, budget, long = 0.004, 64, 600
    prompt = [1 + i % (VOCAB - 1) for i in range(long)]
    p_long = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    sched, alloc, runner = make(num_pages=400, block_size=4, max_num_batched_tokens=budget, max_model_len=1024,
                                attention_cost=a)
    sched.add("short", [3, 4, 5], SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
    out = sched.schedule()
    sched.update(out, runner.run(sched, out))
    sched.add("long", prompt, p_long)
    chunks: list[tuple[int, int]] = []
    while sched.get("long").num_computed_tokens < long:
        out = sched.schedule()
        assert out.num_decodes == 1 and out.seqs[0].req_id == "short"
        (c,) = [s for s in out.seqs if s.req_id == "long"]
        n, s0 = c.num_tokens, c.start_pos
        chunks.append((s0, n))
        assert 1 + n + a * n * (s0 + (n + 1) / 2) <= budget + 1  # the decode, and the chunk by its work
        sched.update(out, runner.run(sched, out))
        check_pages(sched, alloc)
    sizes = [n for _, n in chunks]
    # 63 tokens a step by count alone; by work 56 at the start, 18 past position 500
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == 56 and sizes[-2] == 18
    # Alone, by tokens: whole budgets.
    solo, alloc2, runner2 = make(num_pages=400, block_size=4, max_num_batched_tokens=budget, max_model_len=1024,
                                 attention_cost=a)
    results = drive(solo, alloc2, runner2, [("long", prompt, p_long)])
    assert results["long"] == reference(prompt, p_long, 1024)
    solo.add("again", prompt, p_long)
    assert solo.schedule().seqs[0].num_tokens == budget


def test_beside_decodes_a_step_takes_the_decode_budget_and_a_new_prompt_is_not_starved_by_a_long_one():
    """A running request's time per token is one step, so beside decodes a step takes
    ``decode_step_tokens`` of work, not ``max_num_batched_tokens``. And a long prompt already
    prefilling leaves half of that to a prompt waiting to be admitted: a short prompt arriving
    mid-way is admitted whole at its first step, where the crumbs a long chunk left took it a
    dozen steps. Alone, the long prompt takes whole ``max_num_batched_tokens`` steps."""
    a, step_budget, long = 0.004, 32, 400
    prompt = [1 + i % (VOCAB - 1) for i in range(long)]
    p_long = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    sched, alloc, runner = one_decoding(a, step_budget)
    sched.add("long", prompt, p_long)

    def cost(c):
        return c.num_tokens + a * c.num_tokens * (c.start_pos + (c.num_tokens + 1) / 2)

    while sched.get("long").num_computed_tokens < 200:
        out = sched.schedule()
        assert out.num_decodes == 1
        (c,) = [x for x in out.seqs if x.req_id == "long"]
        assert step_budget - 2 < 1 + cost(c) <= step_budget  # the decode and the chunk: the budget, all of it
        sched.update(out, runner.run(sched, out))
        check_pages(sched, alloc)
    short = [7] * 10
    sched.add("short", short, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    out = sched.schedule()
    got = {x.req_id: x for x in out.seqs}
    assert got["short"].num_tokens == len(short) and got["short"].sample  # whole: its first token now
    assert 1 + cost(got["long"]) + cost(got["short"]) <= step_budget  # the long prompt left it its room
    sched.update(out, runner.run(sched, out))
    out = sched.schedule()  # nobody waits: the long prompt has the step's budget again
    (c,) = [x for x in out.seqs if x.req_id == "long"]
    assert cost(c) > step_budget // 2
    # Alone (no decode waits on its steps): whole max_num_batched_tokens.
    solo, _, _ = make(num_pages=400, block_size=4, max_num_batched_tokens=256, max_model_len=1024,
                      attention_cost=a, decode_step_tokens=step_budget)
    solo.add("long", prompt, p_long)
    assert solo.schedule().seqs[0].num_tokens == 256


def test_a_prompt_admitted_in_a_steps_last_tokens_finishes_before_a_long_prompts_next_chunk():
    """The prompt prefilling with the fewest tokens to go goes first: a prompt admitted with part
    of its tokens (the step had no more) gets the rest at the next step, where by arrival it came
    after every older long prompt and waited for their whole prefills."""
    a, step_budget = 0.004, 32
    sched, alloc, runner = one_decoding(a, step_budget)
    sched.add("long", [1 + i % (VOCAB - 1) for i in range(400)], SamplingParams(temperature=0, max_tokens=2))
    for _ in range(3):
        out = sched.schedule()
        sched.update(out, runner.run(sched, out))
    sched.add("mid", [9] * 24, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    out = sched.schedule()
    got = {x.req_id: x for x in out.seqs}
    assert 0 < got["mid"].num_tokens < 24  # half the step kept for it, not all it needs
    sched.update(out, runner.run(sched, out))
    check_pages(sched, alloc)
    out = sched.schedule()
    got = {x.req_id: x for x in out.seqs}
    assert got["mid"].sample and got["mid"].start_pos + got["mid"].num_tokens == 24  # the rest, first
    sched.update(out, runner.run(sched, out))
    check_pages(sched, alloc)


def test_neither_decodes_nor_short_prompts_starve_the_others():
    """Decodes filling ``decode_step_tokens`` leave prompts a quarter of it (else nothing was
    admitted until a decode ended); a stream of short prompts beside a long one leaves the long
    one its share (fewest-tokens-first alone starved it: 47 of 400 tokens after 200 steps); a
    tiny waiting prompt keeps only what it needs, the rest of the step goes to the long one."""
    p = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    sched, alloc, runner = make(num_pages=600, block_size=4, max_num_batched_tokens=256, max_model_len=1024,
                                decode_step_tokens=8)
    for i in range(8):
        sched.add(f"d{i}", [3, 4, 5], p)
    out = sched.schedule()
    sched.update(out, runner.run(sched, out))
    sched.add("late", [6] * 5, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    out = sched.schedule()
    assert out.num_decodes == 8 and [s.num_tokens for s in out.seqs if s.req_id == "late"] == [2]

    a, step_budget = 0.004, 32
    sched, alloc, runner = make(num_pages=2000, block_size=4, max_num_batched_tokens=256, max_model_len=1024,
                                attention_cost=a, decode_step_tokens=step_budget, max_num_seqs=64)
    sched.add("dec", [3, 4, 5], SamplingParams(temperature=0, max_tokens=900, ignore_eos=True))
    out = sched.schedule()
    sched.update(out, runner.run(sched, out))
    sched.add("long", [1 + i % (VOCAB - 1) for i in range(400)], SamplingParams(temperature=0, max_tokens=1))
    steps = 0
    while sched.get("long") is not None and sched.get("long").num_computed_tokens < 400:
        sched.add(f"s{steps}", [7] * 40, SamplingParams(temperature=0, max_tokens=1))  # one a step: overload
        out = sched.schedule()
        sched.update(out, runner.run(sched, out))
        check_pages(sched, alloc)
        steps += 1
        assert steps < 120, f"the long prompt starved at {sched.get('long').num_computed_tokens} of 400"

    sched, alloc, runner = one_decoding(a, step_budget)
    sched.add("long", [1 + i % (VOCAB - 1) for i in range(400)], SamplingParams(temperature=0, max_tokens=2))
    out = sched.schedule()
    sched.update(out, runner.run(sched, out))
    sched.add("tiny", [9, 9], SamplingParams(temperature=0, max_tokens=1))
    out = sched.schedule()
    got = {x.req_id: x for x in out.seqs}
    used = sum(x.num_tokens + a * x.num_tokens * (x.start_pos + (x.num_tokens + 1) / 2) for x in out.seqs)
    assert got["tiny"].num_tokens == 2 and used > step_budget - 2  # the step used, not half of it


def test_a_part_admitted_prompt_and_the_oldest_share_the_prefill_and_nothing_is_left_unused():
    """The prompt with the fewest tokens to go takes at most half of what the prefilling prompts
    may: a prompt over half a step (no room is kept for it), admitted in the crumbs a long
    prompt's chunk leaves, finishes in a few steps while the oldest keeps the other half. And
    what a waiting prompt was kept but did not use (its prompt found in the prefix cache) goes
    back to the prompts prefilling in the same step."""
    a, step_budget = 0.004, 32
    alloc = PageAllocator(600)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_model_len=1024, eos_token_ids=(EOS,),
                                      attention_cost=a, decode_step_tokens=step_budget),
                      BlockManager(4, alloc, PrefixIndex("m")))
    runner = FakeRunner(600, 4)

    def cost(x):
        return x.num_tokens + a * x.num_tokens * (x.start_pos + (x.num_tokens + 1) / 2)

    def step():
        out = sched.schedule()
        sched.update(out, runner.run(sched, out))
        check_pages(sched, alloc)
        return {x.req_id: x for x in out.seqs}

    chat = [1 + i % 50 for i in range(64)]
    sched.add("chat", chat, SamplingParams(temperature=0, max_tokens=1))
    sched.add("dec", [3, 4, 5], SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
    step()
    sched.add("long", [100 + i % 50 for i in range(400)], SamplingParams(temperature=0, max_tokens=1))
    step()
    sched.add("mid", [9] * 40, SamplingParams(temperature=0, max_tokens=1))  # over half a step: no room kept
    for n in range(1, 8):
        got = step()
        if "mid" in got and got["mid"].sample:
            break
        if "mid" in got and got["mid"].start_pos > 0:  # prefilling beside the long one: half each at most
            assert cost(got["mid"]) <= (step_budget - 1) // 2 + 1 and cost(got["long"]) >= (step_budget - 1) // 2 - 2
    assert got["mid"].sample and n <= 5, n  # in a few steps, not after the long prompt's whole prefill
    sched.add("chat2", chat + [7, 8], SamplingParams(temperature=0, max_tokens=1))
    got = step()
    assert got["chat2"].start_pos == 64 and got["chat2"].sample  # 64 tokens from the cache
    assert 1 + cost(got["long"]) + cost(got["chat2"]) > step_budget - 4  # the step used (to a token deep in it)



def test_only_a_steps_first_chunk_may_overrun_its_allowance():
    """A chunk always moves a prompt by a token, even one costing more than the step has left
    (deep in a long prompt) — the step's first chunk only: a second long prompt's token taken
    over its allowance came out of the room kept for a waiting prompt, admitted then in part."""
    a, step_budget = 0.02, 32
    sched, alloc, runner = make(num_pages=1200, block_size=4, max_num_batched_tokens=256, max_model_len=2048,
                                attention_cost=a, decode_step_tokens=step_budget)
    for rid in ("long1", "long2"):
        sched.add(rid, [1 + i % 50 for i in range(1500)], SamplingParams(temperature=0, max_tokens=1))
    while sched.get("long2").num_computed_tokens < 600:  # alone: whole budgets
        out = sched.schedule()
        sched.update(out, runner.run(sched, out))
    sched.add("dec", [3, 4, 5], SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
    for _ in range(2):
        out = sched.schedule()
        sched.update(out, runner.run(sched, out))
    sched.add("short", [11] * 6, SamplingParams(temperature=0, max_tokens=1))
    out = sched.schedule()
    got = {x.req_id: x for x in out.seqs}
    assert out.num_decodes == 1 and {"long1", "long2"} & set(got)  # a token deep in one costs ~13-16 of 31
    assert got["short"].num_tokens == 6, {k: (v.num_tokens, v.start_pos) for k, v in got.items()}
    check_pages(sched, alloc)


def test_tokens_to_go_is_the_most_any_request_may_still_produce():
    """What the agent reads to drain the busy model nearest to idle: a waiting request counts its
    whole max_tokens, a running one what is left of it, each capped by the context; 0 when idle."""
    sched, alloc, runner = make(num_pages=64, block_size=4, max_num_batched_tokens=64, max_model_len=40)
    assert sched.tokens_to_go == 0
    sched.add("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert sched.tokens_to_go == 10
    for _ in range(4):
        out = sched.schedule()
        sched.update(out, runner.run(sched, out))
    assert sched.tokens_to_go == 6
    sched.add("b", list(range(1, 31)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    assert sched.tokens_to_go == 10  # 40 - 30: the context ends it first
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, runner.run(sched, out))
    assert sched.tokens_to_go == 0


def test_limits_max_num_seqs_and_budget():
    sched, alloc, runner = make(max_num_seqs=2, max_num_batched_tokens=5, max_model_len=64)
    for i in range(4):
        sched.add(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=3))
    out = sched.schedule()
    assert [s.req_id for s in out.seqs] == ["r0", "r1"]
    assert [s.num_tokens for s in out.seqs] == [3, 2] and out.num_batched_tokens == 5
    assert sched.num_running == 2 and sched.num_waiting == 2


@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "mid_decode", "preempted", "twice"])
def test_abort_frees_pages_at_any_point(when):
    sched, alloc, runner = make(num_pages=16, block_size=2, max_num_batched_tokens=4, max_model_len=30)
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    sched.add("a", list(range(1, 11)), p)
    if when != "waiting":
        out = sched.schedule()
        sched.update(out, runner.run(sched, out))
        assert sched.get("a").num_computed_tokens == 4  # mid-prefill
    if when in ("mid_decode", "preempted"):
        for _ in range(3):
            out = sched.schedule()
            sched.update(out, runner.run(sched, out))
        assert sched.get("a").num_output_tokens >= 1
    if when == "preempted":
        sched._preempt(sched.get("a"))
        assert sched.get("a").status is SequenceStatus.WAITING
    seq = sched.abort("a")
    assert seq is not None and seq.finish_reason is FinishReason.ABORT
    assert alloc.num_free == alloc.num_total and not sched.has_unfinished()
    assert sched.abort("a") is None and sched.abort("never") is None
    assert sched.schedule().is_empty


def test_abort_between_schedule_and_update_is_skipped():
    sched, alloc, runner = make()
    sched.add("a", [1, 2], SamplingParams(max_tokens=4))
    sched.add("b", [3, 4], SamplingParams(max_tokens=4))
    out = sched.schedule()
    sampled = runner.run(sched, out)
    sched.abort("a")
    got = sched.update(out, sampled)
    assert [s.req_id for s in got] == ["b"]
    check_pages(sched, alloc)


def test_bad_inputs_are_refused():
    with pytest.raises(SchedulerConfigError):
        make(num_pages=2, block_size=4, max_model_len=64)  # one sequence cannot fit
    with pytest.raises(SchedulerConfigError):
        SchedulerConfig(max_num_seqs=0).validate()
    for bad in (-0.1, 1.0, float("nan"), "0.1"):
        with pytest.raises(SchedulerConfigError, match="attention_cost"):
            SchedulerConfig(attention_cost=bad).validate()
    for bad in (0, -1, 2.5, "8"):
        with pytest.raises(SchedulerConfigError, match="decode_step_tokens"):
            SchedulerConfig(decode_step_tokens=bad).validate()
    sched, alloc, _ = make(max_model_len=8)
    with pytest.raises(ValueError, match="empty"):
        sched.add("x", [], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add("x", list(range(8)), SamplingParams())
    sched.add("x", [1], SamplingParams())
    with pytest.raises(ValueError, match="already live"):
        sched.add("x", [1], SamplingParams())
    out = sched.schedule()
    with pytest.raises(ValueError, match="sampled ids"):
        sched.update(out, [])


def test_context_length_stops_with_length():
    sched, alloc, runner = make(max_model_len=6)
    sched.add("b", [1, 2, 3, 4], SamplingParams(max_tokens=100, ignore_eos=True))
    outs = []
    while sched.has_unfinished():
        out = sched.schedule()
        outs += [(s.finish_reason, s.num_tokens) for s in sched.update(out, runner.run(sched, out))]
    assert outs == [(None, 5), (FinishReason.LENGTH, 6)]
    assert alloc.num_free == alloc.num_total


def test_public_preempt_frees_pages_and_resumes_oldest_first():
    sched, alloc, runner = make(max_model_len=64)
    reqs = [(f"r{i}", [i + 1] * (3 + i), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)) for i in range(3)]
    for rid, p, sp in reqs:
        sched.add(rid, p, sp)
    for _ in range(2):
        out = sched.schedule()
        sched.update(out, runner.run(sched, out))
    sched.add("fresh", [9, 9], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert sched.preempt("r2") and sched.preempt("r0")
    assert not sched.preempt("r0") and not sched.preempt("nope")  # not running (any more)
    assert [s.req_id for s in sched.waiting] == ["r0", "r2", "fresh"]
    assert not sched.blocks.has(sched.get("r0").seq_id)
    check_pages(sched, alloc)
    results = {}
    while sched.has_unfinished():
        out = sched.schedule()
        for seq in sched.update(out, runner.run(sched, out)):
            if seq.finish_reason is not None:
                results[seq.req_id] = (seq.output_token_ids, seq.finish_reason.value)
    for rid, p, sp in reqs:
        assert results[rid] == reference(p, sp, 64)
    assert alloc.num_free == alloc.num_total


def test_plain_data_modules_import_no_torch():
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, engine, engine.sched.scheduler, engine.sched.block_manager, engine.sched.sequence, engine.sampling, "
            "engine.sched.prefix_index, "
            "engine.config, engine.errors; engine.SamplingParams; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2],
                          timeout=60).returncode == 0

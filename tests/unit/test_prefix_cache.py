"""Automatic prefix caching in the scheduler and block manager, against the fake model of
tests/unit/test_scheduler.py, which derives every token from what it *reads back* through the
block tables: a cached page handed to a sequence whose tokens it does not hold, a page reused
while still indexed, or a wrong start position changes the output, and every schedule must give
the reference tokens. The invariants (references = tables holding a page; only indexed pages
shared; an indexed page is held or cached-free, never plain free; nothing leaked) hold after every step.
"""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampling import SamplingParams
from engine.sched.block_manager import BlockManager, PageAllocator
from engine.sched.prefix_index import PrefixIndex, block_key, root_key
from engine.sched.scheduler import Scheduler, SchedulerConfig
from engine.sched.sequence import SequenceStatus
from tests.unit.test_scheduler import EOS, VOCAB, FakeRunner, drive, reference

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)  # the prompt's K/V only: its last token's is never written


def make(num_pages=64, block_size=4, **cfg):
    alloc = PageAllocator(num_pages)
    cfg.setdefault("eos_token_ids", (EOS,))
    cfg.setdefault("max_model_len", 64)
    sched = Scheduler(SchedulerConfig(**cfg), BlockManager(block_size, alloc, PrefixIndex("model-a")))
    return sched, alloc, FakeRunner(num_pages, block_size)


def check_cache(sched: Scheduler, alloc: PageAllocator) -> None:
    bm, index = sched.blocks, sched.blocks.prefix
    tables = {sid: bm.block_table(sid) for sid in bm.live_sequences()}
    held = Counter(p for t in tables.values() for p in t)
    cached_free = set(alloc.cached_free_pages())
    assert all(bm.refs(p) == n for p, n in held.items()), "a reference count is off"
    assert bm.num_used_pages == len(held) and alloc.num_free + len(held) == alloc.num_total, "a page leaked"
    assert not cached_free & set(held), "a cached-free page is in a table"
    assert all(index.key(p) is not None for p in cached_free), "a cached-free page lost its index entry"
    assert all(p in held or p in cached_free for p in index.pages()), "an indexed page is plain free"
    by_id = {s.seq_id: s for s in sched.running}
    check_shared_pages_are_full(bm, by_id)
    assert set(tables) <= set(by_id), "a waiting or finished sequence holds pages"
    for sid, table in tables.items():
        seq = by_id[sid]
        assert len(table) * bm.block_size >= seq.num_computed_tokens
        for i, p in enumerate(table[:len(seq.block_keys)]):
            key = index.key(p)
            assert key is None or key == seq.block_keys[i], "a page sits at another block's place"
    assert len(sched.running) <= sched.config.max_num_seqs


def check_shared_pages_are_full(bm: BlockManager, seqs: dict) -> None:
    """A page in two tables is at the same block of both, and full in both: no one writes it."""
    where: dict[int, set[int]] = {}
    for sid in bm.live_sequences():
        seq = seqs[sid]
        for i, p in enumerate(bm.block_table(sid)):
            where.setdefault(p, set()).add(i)
            if bm.refs(p) > 1:
                assert (i + 1) * bm.block_size <= seq.num_computed_tokens, "a shared page is still being written"
    assert all(len(blocks) == 1 for blocks in where.values()), "a page sits at two blocks"


def shared_requests(rng: random.Random, n: int, block_size: int, max_len: int):
    """Requests that share: a few system prompts, whole prompts again, and chat turns (a
    previous prompt, its reference answer, a new user turn)."""
    systems = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 3 * block_size + 1))]
               for _ in range(rng.randint(1, 3))]
    reqs: list[tuple[str, list[int], SamplingParams]] = []
    for i in range(n):
        params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 8), ignore_eos=rng.random() < 0.5)
        r = rng.random()
        if r < 0.2 and reqs:
            prompt = list(rng.choice(reqs)[1])
        elif r < 0.4 and reqs:
            _, prev, prev_params = rng.choice(reqs)
            prompt = prev + reference(prev, prev_params, max_len)[0] + [rng.randrange(1, VOCAB)]
        else:
            prompt = rng.choice(systems) + [rng.randrange(1, VOCAB) for _ in range(rng.randint(0, 5))]
        reqs.append((f"r{i}", prompt[: max_len - 2], params))
    return reqs


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(1, 48),
    max_num_seqs=st.integers(1, 8),
    chunk=st.sampled_from([None, 1, 3, 17]),
    spare_pages=st.integers(0, 24),
    aborts=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 9)), max_size=3),
)
def test_any_schedule_with_shared_prefixes_gives_reference_tokens(seed, block_size, budget, max_num_seqs, chunk,
                                                                  spare_pages, aborts):
    rng = random.Random(seed)
    max_model_len = 40
    reqs = shared_requests(rng, rng.randint(1, 10), block_size, max_model_len)
    abort_at: dict[int, list[str]] = {}
    for step, i in aborts:
        if i < len(reqs):
            abort_at.setdefault(step, []).append(f"r{i}")
    num_pages = -(-max_model_len // block_size) + spare_pages  # tight: preemption and eviction
    sched, alloc, runner = make(num_pages, block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                max_model_len=max_model_len, max_prefill_chunk=chunk)
    results = drive(sched, alloc, runner, reqs, abort_at=abort_at, check=check_cache)
    for req_id, prompt, params in reqs:
        want = reference(prompt, params, max_model_len)
        got = results[req_id]
        if got[1] == "abort":
            assert got[0] == want[0][: len(got[0])], req_id
        else:
            assert got == want, req_id


def _run(sched, runner, req_id, prompt, params=GREEDY):
    sched.add(req_id, prompt, params)
    firsts = []
    while sched.get(req_id) is not None:
        out = sched.schedule()
        firsts += [(s.start_pos, s.num_tokens) for s in out.seqs if s.req_id == req_id]
        sched.update(out, runner.run(sched, out))
    return firsts


def test_a_repeated_prompt_computes_only_what_is_not_cached():
    sched, alloc, runner = make(block_size=4)
    prompt = list(range(1, 11))  # 10 tokens: blocks 0 and 1 full
    first = _run(sched, runner, "a", prompt)
    assert first[0] == (0, 10)
    seq_b = sched.add("b", prompt, GREEDY)
    out = sched.schedule()
    assert [(s.start_pos, s.num_tokens) for s in out.seqs] == [(8, 2)]  # 8 cached, the budget pays for 2
    assert seq_b.num_cached_tokens == 8 and sched.blocks.prefix.hit_tokens == 8
    assert sched.blocks.prefix.queried_tokens == 20
    sched.update(out, runner.run(sched, out))
    check_cache(sched, alloc)


def test_a_fully_cached_prompt_still_computes_its_last_token():
    sched, alloc, runner = make(block_size=4)
    _run(sched, runner, "a", list(range(1, 9)) + [20, 21, 22, 23])  # 12 tokens, 3 full blocks
    sched.add("b", list(range(1, 9)), GREEDY)  # exactly two blocks, both cached
    out = sched.schedule()
    assert [(s.start_pos, s.num_tokens, s.sample) for s in out.seqs] == [(4, 4, True)]


def test_output_tokens_are_cached_for_the_next_turn():
    """A chat's next turn resends the answer: its pages (computed as decodes) hit too."""
    sched, alloc, runner = make(block_size=2, max_model_len=64)
    prompt = [5, 6, 7]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    _run(sched, runner, "t1", prompt, params)
    answer = reference(prompt, params, 64)[0]
    turn2 = prompt + answer + [9]
    seq = sched.add("t2", turn2, GREEDY)
    out = sched.schedule()
    # prompt + answer is 9 tokens; the answer's last token was never fed back (no K/V): 8 cached
    assert seq.num_cached_tokens == 8 and out.seqs[0].start_pos == 8


def test_cached_free_pages_go_least_recent_first_and_leave_the_index():
    sched, alloc, runner = make(num_pages=8, block_size=4, max_model_len=32)
    _run(sched, runner, "a", [1] * 9, ONE)  # two full blocks each (the two keys differ: a chain)
    _run(sched, runner, "b", [2] * 9, ONE)
    index = sched.blocks.prefix
    cached_free = alloc.cached_free_pages()
    assert len(index) == len(cached_free) == 4  # a's tail block, a's head, b's tail, b's head
    # A 20-token prompt needs 5 pages: the 4 plain free ones, then the least recently freed:
    # a's tail block (a sequence's head outlives its tail: shared heads are the likelier hits).
    keys = {p: index.key(p) for p in cached_free}
    _run(sched, runner, "c", [3] * 20, ONE)
    assert index.key(cached_free[0]) != keys[cached_free[0]]  # handed to c (and now indexed under c's key)
    assert all(index.key(p) == keys[p] for p in cached_free[1:])
    a_again = sched.add("a2", [1] * 9, GREEDY)
    sched.schedule()
    assert a_again.num_cached_tokens == 4  # a's head block only
    check_cache(sched, alloc)


def test_a_preempted_sequence_resumes_from_its_own_cached_free_pages():
    sched, alloc, runner = make(block_size=2, max_model_len=40)
    sched.add("a", list(range(1, 12)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for _ in range(3):
        out = sched.schedule()
        sched.update(out, runner.run(sched, out))
    seq = sched.get("a")
    done = seq.num_computed_tokens
    assert sched.preempt("a")
    out = sched.schedule()
    assert out.seqs[0].start_pos == (min(done, seq.num_tokens - 1) // 2) * 2  # every computed full block hit
    sched.update(out, runner.run(sched, out))
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, runner.run(sched, out))
    assert seq.output_token_ids == reference(list(range(1, 12)), seq.params, 40)[0]


def test_dropping_the_cache_frees_cached_free_pages_and_keeps_live_ones():
    sched, alloc, runner = make(block_size=4)
    _run(sched, runner, "a", list(range(1, 10)), ONE)
    sched.add("live", list(range(1, 10)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    out = sched.schedule()
    sched.update(out, runner.run(sched, out))
    assert alloc.num_cached_free == 0 and len(sched.blocks.prefix) == 2  # the live one holds them
    assert sched.blocks.drop_prefix_cache() == 2
    check_cache(sched, alloc)
    sched.abort("live")
    assert alloc.num_cached_free == 0 and alloc.num_free == alloc.num_total
    again = sched.add("b", list(range(1, 10)), GREEDY)
    sched.schedule()
    assert again.num_cached_tokens == 0


def test_keys_chain_and_depend_on_the_salt():
    a, b = root_key("model-a"), root_key("model-b")
    assert a != b and len(a) == 16
    assert block_key(a, [1, 2]) != block_key(b, [1, 2])
    assert block_key(block_key(a, [1, 2]), [3, 4]) != block_key(block_key(a, [9, 2]), [3, 4])  # the chain
    assert block_key(a, [1, 2]) == block_key(a, [1, 2])
    assert block_key(a, [1 << 40]) != block_key(a, [0])  # ids are not truncated


def check_pool_models(pool, scheds: dict[str, Scheduler]) -> None:
    pool.audit()
    for name, sched in scheds.items():
        bm, index = sched.blocks, sched.blocks.prefix
        held = Counter(p for sid in bm.live_sequences() for p in bm.block_table(sid))
        cached_free = set(pool.cached_free_pages(name))
        assert all(bm.refs(p) == n for p, n in held.items()) and pool.num_used(name) == len(held)
        assert all(index.key(p) is not None for p in cached_free), "a cached-free page lost its index entry"
        assert all(p in held or p in cached_free for p in index.pages()), "an indexed page is free or another's"
        check_shared_pages_are_full(bm, {seq.seq_id: seq for seq in sched.running})


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), block_size=st.sampled_from([2, 4]), budget=st.integers(2, 32),
       spare_pages=st.integers(0, 12), shrinks=st.lists(st.integers(0, 60), max_size=3))
def test_two_models_in_one_pool_with_shrinks_and_drops_give_reference_tokens(seed, block_size, budget, spare_pages,
                                                                             shrinks):
    """Two models' caches in one PagePool: their cached-free pages are free for both; a shrink
    (fence, preempt the holders of fenced pages, resize) and a grow back, and dropping a
    model's cache, never change a token."""
    import torch

    from engine.kv.layout import PoolExhausted
    from engine.kv.page_pool import PagePool

    rng = random.Random(seed)
    max_len = 32
    per_seq = -(-max_len // block_size)
    full = 2 * per_seq + spare_pages
    pool = PagePool(full, 1024)
    scheds, runner, pending, results = {}, FakeRunner(full, block_size), {}, {}
    for m in ("a", "b"):
        pool.register(m, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, min_pages=per_seq,
                      tokens_per_page=block_size)
        scheds[m] = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=max_len,
                                              eos_token_ids=(EOS,)),
                              BlockManager(block_size, pool.allocator_for(m), PrefixIndex(f"model-{m}")))
        pending[m] = [(f"{m}{rid}", p, sp) for rid, p, sp in shared_requests(rng, rng.randint(1, 8), block_size, max_len)]
    shrink_at = set(shrinks)
    fenced_to: int | None = None
    for step in range(5_000):
        if not any(pending.values()) and not any(s.has_unfinished() for s in scheds.values()):
            break
        m = rng.choice(["a", "b"])
        sched = scheds[m]
        if pending[m] and rng.random() < 0.5:
            rid, prompt, params = pending[m].pop(0)
            sched.add(rid, prompt, params)
            results[rid] = ([], "", prompt, params)
        if step in shrink_at and fenced_to is None:
            try:
                pool.fence(2 * per_seq)  # the minimums' worth: the spare pages go
                fenced_to = 2 * per_seq
            except PoolExhausted:  # the minimums cannot be kept below it right now: not this time
                pass
        if fenced_to is not None:
            for name, s in scheds.items():  # what the engine does: holders of fenced pages start over
                for seq in list(s.running):
                    if any(p >= fenced_to for p in s.blocks.block_table(seq.seq_id)):
                        s.preempt(seq.req_id)
            if pool.num_fenced_in_use() == 0:
                pool.resize(fenced_to)
                pool.resize(full)  # and grow back
                fenced_to = None
        if rng.random() < 0.02:
            sched.blocks.drop_prefix_cache()
        out = sched.schedule()
        sampled = runner.run(sched, out)
        for seq in sched.update(out, sampled):
            results[seq.req_id][0].append(seq.token_ids[-1])
            if seq.finish_reason is not None:
                results[seq.req_id] = (results[seq.req_id][0], seq.finish_reason.value) + results[seq.req_id][2:]
        check_pool_models(pool, scheds)
    else:
        raise AssertionError("no progress")
    for rid, (toks, reason, prompt, params) in results.items():
        assert (toks, reason) == reference(prompt, params, max_len), rid


def test_extending_a_chain_gives_the_keys_block_by_block():
    from engine.sched.prefix_index import extend_keys

    root = root_key("m")
    tokens = list(range(100, 123))
    keys: list[bytes] = []
    extend_keys(keys, root, tokens, 4, 9)  # two full blocks below token 9
    extend_keys(keys, root, tokens, 4, 9)  # nothing new
    extend_keys(keys, root, tokens, 4, 23)  # three more
    want, parent = [], root
    for i in range(5):
        parent = block_key(parent, tokens[4 * i:4 * i + 4])
        want.append(parent)
    assert keys == want

"""Two tiny models on one shared PagePool, stepped by the FairSharePicker, booked in the
MemoryLedger: built from the engine's public pieces (scheduler, block manager, KV cache views,
model runner) the way docs/multi-model.md tells EngineCore to hold them.

The oracle is each model served alone by EngineCore with its own KV cache: sharing the pool
(pages moving between models whose pages hold different token counts), interleaved steps and
preemption under a small pool must not change a single greedy token.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine.sched.block_manager import BlockManager
from engine.config import load_model_config
from engine.core.engine_core import EngineCore
from engine.options import EngineOptions
from engine.core.fair_share import FairSharePicker
from engine.kv.kv_cache import KVCache, KVSpec
from engine.weights.loader import load_weights
from engine.core.ledger import MemoryLedger
from engine.runner.model_runner import ModelRunner
from engine.models.llama import LlamaModel
from engine.kv.layout import ModelPageSource
from engine.kv.page_pool import PagePool
from engine.sampling import SamplingParams
from engine.sched.scheduler import Scheduler, SchedulerConfig
from engine.load_spec import LoadSpec

MAX_LEN = 64
BATCH_TOKENS = 128
MAX_SEQS = 8
PAGE_BYTES = 16 * 1024  # tiny llama: 512 B/token → 32 tokens a page; tiny qwen3: 1 KiB → 16
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = {
    "llama": [list(range(40, 40 + n)) for n in (1, 5, 19, 33, 8)],
    "qwen3": [list(range(70, 70 + n)) for n in (30, 2, 17, 9, 24)],
}


class Recording:
    """A page source that remembers every page id it handed out (to see pages move)."""

    def __init__(self, inner: ModelPageSource) -> None:
        self.inner = inner
        self.seen: set[int] = set()

    @property
    def num_free(self) -> int:
        return self.inner.num_free

    @property
    def num_total(self) -> int:
        return self.inner.num_total

    def allocate(self) -> int:
        page = self.inner.allocate()
        self.seen.add(page)
        return page

    def free(self, page_id: int) -> None:
        self.inner.free(page_id)


@dataclass
class Served:
    scheduler: Scheduler
    runner: ModelRunner
    pages: Recording


def serve(name: str, model_dir, pool: PagePool, ledger: MemoryLedger, min_pages: int) -> Served:
    cfg = load_model_config(model_dir)
    model = LlamaModel(cfg, torch.float32, torch.device("cpu"))
    weight_bytes = load_weights(model, model_dir)
    model.build_rope_cache(MAX_LEN)
    ledger.reserve_weights(name, weight_bytes, min_kv_bytes=min_pages * pool.page_bytes)
    lay = pool.register(name, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                        head_dim=cfg.head_dim, dtype=torch.float32, min_pages=min_pages)
    spec = KVSpec(cfg.num_layers, lay.tokens_per_page, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    if lay.tokens_per_page * lay.bytes_per_token == pool.page_bytes:
        kv = KVCache.from_buffer(spec, pool.flat_buffer(name))
    else:  # padded pages: per-layer views with the whole page as page stride
        kv = KVCache.from_views(spec, pool.kv_views(name))
    pages = Recording(pool.allocator_for(name))
    sched = Scheduler(SchedulerConfig(max_num_seqs=MAX_SEQS, max_num_batched_tokens=BATCH_TOKENS,
                                      max_model_len=MAX_LEN, eos_token_ids=cfg.eos_token_ids),
                      BlockManager(lay.tokens_per_page, pages))
    return Served(sched, ModelRunner(model, kv, BATCH_TOKENS, MAX_SEQS, MAX_LEN), pages)


def step(served: dict[str, Served], picker: FairSharePicker, toks: dict[str, list[int]]) -> str | None:
    """One engine step: pick a model, schedule, run, sample, charge the step's cost.

    The engine charges measured seconds; here the cost is a fixed function of the batch (a
    step overhead plus a per-token term), so the interleaving, and the test, do not depend on
    how loaded the machine running it is.
    """
    name = picker.pick([n for n, s in served.items() if s.scheduler.has_unfinished()])
    if name is None:
        return None
    s = served[name]
    out = s.scheduler.schedule()
    if not out.is_empty:
        result = s.runner.execute(out)
        for seq in s.scheduler.update(out, result.token_ids):
            toks[seq.req_id].append(seq.token_ids[-1])
    picker.charge(name, 0.002 + 0.0001 * out.num_batched_tokens)
    return name


@pytest.fixture(scope="module")
def dirs(make_tiny_model):
    return {"llama": make_tiny_model("llama"), "qwen3": make_tiny_model("qwen3")}


@pytest.fixture(scope="module")
def solo(dirs):
    """Each model alone in EngineCore, all its prompts at once."""
    out = {}
    for name, model_dir in dirs.items():
        core = EngineCore(EngineOptions(max_num_batched_tokens=BATCH_TOKENS, seed=1), device="cpu")
        core.load_model(LoadSpec(name, model_dir, max_model_len=MAX_LEN, max_num_seqs=MAX_SEQS))
        for i, p in enumerate(PROMPTS[name]):
            core.add_request(f"{name}{i}", name, p, GREEDY)
        while core.has_unfinished_requests():
            for o in core.step():
                out.setdefault(o.req_id, []).extend(o.new_token_ids)
    return out


def make_pool(dirs, num_pages: int, min_pages: int, page_bytes: int = PAGE_BYTES):
    pool = PagePool(num_pages, page_bytes, device="cpu")
    ledger = MemoryLedger(64 * 1024**2)
    start = ledger.snapshot()
    served = {n: serve(n, d, pool, ledger, min_pages) for n, d in dirs.items()}
    ledger.set_kv_pool(pool.nbytes)
    picker = FairSharePicker()
    for name in served:
        picker.add_model(name)
    return pool, ledger, start, served, picker


# 256 B of padding a page: the same token counts, but no model fills its page exactly.
@pytest.mark.parametrize("num_pages, min_pages, page_bytes",
                         [(64, 2, PAGE_BYTES), (12, 3, PAGE_BYTES), (12, 3, PAGE_BYTES + 256)])
def test_two_models_share_one_pool_token_identically(dirs, solo, num_pages, min_pages, page_bytes):
    pool, ledger, start, served, picker = make_pool(dirs, num_pages, min_pages, page_bytes)
    assert pool.layout("llama").tokens_per_page == 32 and pool.layout("qwen3").tokens_per_page == 16
    toks: dict[str, list[int]] = {}
    for name, s in served.items():
        for i, p in enumerate(PROMPTS[name]):
            toks[f"{name}{i}"] = []
            s.scheduler.add(f"{name}{i}", p, GREEDY)
    ran = []
    while (name := step(served, picker, toks)) is not None:
        ran.append(name)
        pool.audit()
        assert len(ran) < 2000
    assert toks == solo
    assert {"llama", "qwen3"} <= set(ran[: len(ran) // 2])  # interleaved, not one after the other
    if num_pages == 12:  # a pool too small for both at once: pages served one model, then the other
        assert served["llama"].pages.seen & served["qwen3"].pages.seen
    assert pool.num_free == num_pages and all(pool.num_used(n) == 0 for n in served)
    for name in served:
        pool.unregister(name)
        ledger.release(name)
    ledger.set_kv_pool(0)
    assert ledger.snapshot() == start


def test_unloading_one_model_mid_stream_frees_its_pages_and_bytes(dirs, solo):
    pool, ledger, start, served, picker = make_pool(dirs, 64, 2)
    toks: dict[str, list[int]] = {}
    for name, s in served.items():
        for i, p in enumerate(PROMPTS[name]):
            toks[f"{name}{i}"] = []
            s.scheduler.add(f"{name}{i}", p, GREEDY)
    for _ in range(6):
        step(served, picker, toks)
    assert pool.num_used("qwen3") > 0
    # Unload qwen3 (past its drain deadline): abort what is left, unregister, release the bytes.
    gone = served.pop("qwen3")
    for i in range(len(PROMPTS["qwen3"])):
        gone.scheduler.abort(f"qwen3{i}")
    assert pool.num_used("qwen3") == 0
    pool.unregister("qwen3")
    picker.remove_model("qwen3")
    ledger.release("qwen3")
    pool.audit()
    while step(served, picker, toks) is not None:
        pass
    assert {k: v for k, v in toks.items() if k.startswith("llama")} == \
        {k: v for k, v in solo.items() if k.startswith("llama")}
    pool.unregister("llama")
    ledger.release("llama")
    ledger.set_kv_pool(0)
    assert pool.num_free == 64 and ledger.snapshot() == start


def test_quiet_model_gets_its_first_token_next_to_a_flooded_one(dirs):
    pool, ledger, start, served, picker = make_pool(dirs, 64, 2)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    toks: dict[str, list[int]] = {}
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for i in range(4):  # flood: a batch of long generations
        toks[f"flood{i}"] = []
        served["llama"].scheduler.add(f"flood{i}", list(range(10, 30 + i)), long)
    for _ in range(5):
        assert step(served, picker, toks) == "llama"
    waits = []
    for j in range(3):  # a trickle: one short request at a time, arriving mid-flood
        rid = f"quiet{j}"
        toks[rid] = []
        served["qwen3"].scheduler.add(rid, list(range(50, 60)), short)
        steps = 0
        while not toks[rid]:
            step(served, picker, toks)
            steps += 1
        waits.append(steps)
        while served["qwen3"].scheduler.has_unfinished():  # let it finish, flood still running
            step(served, picker, toks)
        assert served["llama"].scheduler.has_unfinished()
    # Solo, the first token comes from the first step; next to the flood, at most one llama step
    # runs before it (the idle model joins at the flood's virtual time and wins the tie).
    assert max(waits) <= 2, waits

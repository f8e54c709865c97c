"""The real worker process keeps decoding one model while it loads another.

The worker gets a ``sitecustomize`` (through PYTHONPATH) that holds the weight read of any model
folder named ``slow-*`` until a gate file exists, and says when a read is waiting there. The
test opens the gate only after every token of the other model has arrived: no timing involved.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import pytest
import uvloop

from agent.worker import client as wc
from engine.load_spec import LoadSpec
from engine.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
SITE = '''
import os, sys, time
sys.path.insert(0, {root!r})
import engine.core.loading as _cl
_real, _gate = _cl.load_or_restore, {gate!r}

def _gated(model, model_dir, tier=None, key=None, *, cancel=None):
    if os.path.basename(str(model_dir)).startswith("slow-"):
        open(_gate + ".entered", "w").close()
        while not os.path.exists(_gate) and not (cancel is not None and cancel.is_set()):
            time.sleep(0.005)
    return _real(model, model_dir, tier, key, cancel=cancel)

_cl.load_or_restore = _gated
'''
SAMPLING = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture
def gated(tmp_path, monkeypatch, make_tiny_model):
    site = tmp_path / "site"
    site.mkdir()
    gate = tmp_path / "gate"
    (site / "sitecustomize.py").write_text(SITE.format(root=str(ROOT), gate=str(gate)))
    monkeypatch.setenv("PYTHONPATH", str(site))
    slow = tmp_path / "slow-b"
    shutil.copytree(make_tiny_model("llama", seed=1), slow)
    return gate, make_tiny_model("llama"), slow


async def _wait_file(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path.name} did not appear")
        await asyncio.sleep(0.01)


async def _drain(req: wc.EngineRequest) -> list[int]:
    toks: list[int] = []
    while True:
        out = await asyncio.wait_for(req.queue.get(), 60)
        assert not isinstance(out, Exception), out
        toks += out.new_token_ids
        if out.finish_reason is not None:
            return toks


def _run(body) -> None:
    async def main() -> None:
        c = wc.WorkerClient({"device": "cpu", "max_num_batched_tokens": 64,
                             "cpu_memory_budget_bytes": 256 << 20}, engine="core")
        await asyncio.wait_for(c.start(), 120)
        assert c.alive and not c.state.engine_error, c.state.engine_error
        try:
            await body(c)
        finally:
            await c.stop(timeout=10)

    uvloop.run(main())


def test_a_model_decodes_while_another_loads_in_the_worker(gated):
    gate, da, slow = gated

    async def body(c: wc.WorkerClient) -> None:
        await c.load(LoadSpec("a", str(da), max_model_len=128, max_num_seqs=4))
        ref = await _drain(c.add("warm", "a", [5, 9, 2, 7], SAMPLING))
        load_b = asyncio.ensure_future(c.load(LoadSpec("b", str(slow), max_model_len=128, max_num_seqs=4)))
        await _wait_file(Path(str(gate) + ".entered"))
        assert await _drain(c.add("r1", "a", [5, 9, 2, 7], SAMPLING)) == ref
        assert not load_b.done()  # all 40 tokens of "a" came while "b" was loading
        gate.touch()
        loaded = await asyncio.wait_for(load_b, 60)
        assert loaded.model == "b" and loaded.info.kv_pages > 0
        assert len(await _drain(c.add("r2", "b", [5, 9, 2, 7], SAMPLING))) == 40
        deadline = time.monotonic() + 10  # the next Status carries the engine's memory split
        while c.state.memory is None or set(c.state.memory.models) != {"a", "b"}:
            assert time.monotonic() < deadline, c.state.memory
            await asyncio.sleep(0.05)
        assert c.state.memory.weights == sum(m.weights for m in c.state.memory.models.values())

    _run(body)


def test_an_unload_cancels_a_load_in_flight_in_the_worker(gated):
    gate, da, slow = gated

    async def body(c: wc.WorkerClient) -> None:
        await c.load(LoadSpec("a", str(da), max_model_len=128, max_num_seqs=4))
        load_b = asyncio.ensure_future(c.load(LoadSpec("b", str(slow), max_model_len=128, max_num_seqs=4)))
        await _wait_file(Path(str(gate) + ".entered"))
        await asyncio.wait_for(c.unload("b"), 60)
        with pytest.raises(wc.WorkerError) as ei:
            await asyncio.wait_for(load_b, 60)
        assert ei.value.code == "cancelled"
        gate.touch()
        await c.load(LoadSpec("b", str(slow), max_model_len=128, max_num_seqs=4))  # the books were released
        assert len(await _drain(c.add("r", "b", [1, 2, 3], SAMPLING))) == 40

    _run(body)

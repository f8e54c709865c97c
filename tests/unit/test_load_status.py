"""The engine's memory split and warm tier in the worker's Status: records, bounded in rows, optional in v1."""

from __future__ import annotations

import msgpack
import pytest

from engine.stats import MemoryStats, ModelMemory, WarmTierStats
from engine.worker import protocol as P


def _memory(n: int) -> MemoryStats:
    models = {f"m{i}": ModelMemory(weights=i, workspace=2, kv_min=3, kv_used=4, kv_pages_used=5, kv_pages_total=6)
              for i in range(n)}
    return MemoryStats(budget=100, used=60, free=40, weights=30, workspace=10, kv=20, kv_used=5, page_bytes=2, device=0,
                       kv_pages=10, kv_pages_free=7, untracked=0, models=models, models_omitted=0)


def test_status_memory_round_trips_and_is_bounded():
    mem = _memory(3).largest(P.STATUS_MEMORY_MODELS)
    assert mem.budget == 100 and mem.models_omitted == 0 and list(mem.models) == ["m2", "m1", "m0"]
    assert mem.models["m2"] == ModelMemory(weights=2, workspace=2, kv_min=3, kv_used=4, kv_pages_used=5,
                                           kv_pages_total=6)
    msg = P.Status(steps=1, busy=False, models={}, memory=mem)
    [back] = P.FrameDecoder().feed(P.encode(msg))
    assert back == msg and isinstance(back.memory, MemoryStats) and isinstance(back.memory.models["m0"], ModelMemory)
    big = _memory(P.STATUS_MEMORY_MODELS + 5).largest(P.STATUS_MEMORY_MODELS)
    assert len(big.models) == P.STATUS_MEMORY_MODELS and big.models_omitted == 5
    assert "m0" not in big.models  # the smallest go first


def test_a_status_without_memory_still_decodes():
    body = P.Status(steps=3, busy=True).to_wire()
    del body["memory"], body["warm_tier"]
    frame = msgpack.packb(body, use_bin_type=True)
    got = P.decode(frame)
    assert isinstance(got, P.Status) and got.memory is None and got.warm_tier is None and got.models == {}


def test_status_warm_tier_round_trips():
    tier = WarmTierStats(budget=64 << 30, ready=3 << 30, used=16 << 30, models=1)
    msg = P.Status(steps=2, busy=True, warm_tier=tier)
    [back] = P.FrameDecoder().feed(P.encode(msg))
    assert back == msg and isinstance(back.warm_tier, WarmTierStats)


@pytest.mark.parametrize("edit, why", [
    (lambda w: w["memory"].pop("kv_pages_free"), "status.memory: missing field 'kv_pages_free'"),
    (lambda w: w["memory"]["models"]["m0"].update(weights="x"), r"status.memory.models\['m0'\].weights: unexpected"),
    (lambda w: w["models"].update(m={"running": 1}), r"status.models\['m'\]: missing field"),
    (lambda w: w.update(warm_tier={"budget": 1, "ready": 1, "used": "x", "models": 0}), "status.warm_tier.used: unexpected"),
])
def test_a_status_is_decoded_strictly(edit, why):
    body = P.Status(steps=1, busy=False, models={}, memory=_memory(1)).to_wire()
    edit(body)
    with pytest.raises(P.ProtocolError, match=why):
        P.decode(msgpack.packb(body, use_bin_type=True))

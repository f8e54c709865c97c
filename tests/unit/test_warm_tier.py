"""engine.warm_tier on CPU: byte-exact round trips, LRU eviction under the budget, refusals."""

from __future__ import annotations

import pytest
import torch

from engine.warm_tier import WarmTier, WarmTierError


def model(seed, n=1000):
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(n, 8, generator=g).bfloat16(), "norm": torch.randn(8, generator=g),
            "qkv": torch.randn(24, 8, generator=g).half()[:, :5]}  # non-contiguous source


def nbytes(m):
    return sum((t.numel() * t.element_size() + 255) // 256 * 256 for t in m.values())


def test_round_trip_and_restore_into_new_tensors():
    tier = WarmTier(10 << 20, pin=False)
    m = model(1)
    assert tier.put("a", m)
    got = tier.get("a")
    assert set(got) == set(m) and all(torch.equal(got[k], m[k]) for k in m)
    dst = {k: torch.full(t.shape, float("nan"), dtype=t.dtype) for k, t in m.items()}
    assert tier.restore("a", dst)
    assert all(torch.equal(dst[k], m[k]) for k in m)
    assert tier.used_bytes == nbytes(m)
    assert not tier.restore("nope", dst)


def test_lru_eviction_under_budget():
    m = model(2)
    tier = WarmTier(2 * nbytes(m) + 100, pin=False)
    assert tier.put("a", m) and tier.put("b", model(3))
    assert tier.get("a") is not None  # a becomes most recently used
    assert tier.put("c", model(4))  # evicts b, the least recently used
    assert tier.models() == ["a", "c"]
    assert tier.used_bytes <= tier.budget_bytes
    assert torch.equal(tier.get("a")["embed"], m["embed"])


def test_too_big_is_refused_without_evicting():
    m = model(5)
    tier = WarmTier(nbytes(m), pin=False)
    assert tier.put("a", m)
    assert not tier.put("huge", model(6, n=5000))
    assert tier.models() == ["a"]


def test_replace_same_name_and_discard():
    tier = WarmTier(10 << 20, pin=False)
    tier.put("a", model(7))
    m2 = model(8)
    tier.put("a", m2)
    assert tier.models() == ["a"] and torch.equal(tier.get("a")["norm"], m2["norm"])
    assert tier.discard("a") and not tier.discard("a") and tier.used_bytes == 0


def test_restore_mismatch_raises():
    tier = WarmTier(10 << 20, pin=False)
    m = model(9)
    tier.put("a", m)
    bad = {k: torch.empty(t.shape, dtype=t.dtype) for k, t in m.items()}
    bad["norm"] = torch.empty(9)
    with pytest.raises(WarmTierError):
        tier.restore("a", bad)
    with pytest.raises(WarmTierError):
        tier.restore("a", {"embed": bad["embed"]})
    with pytest.raises(WarmTierError):
        WarmTier(-1)

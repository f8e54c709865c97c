"""Warm-tier bookkeeping a reload relies on: keep without a copy, notes that go with the entry."""

from __future__ import annotations

import torch

from engine.weights.warm_tier import WarmTier


def _tensors(seed: int, rows: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(rows, 4, generator=g), "b": torch.randn(4, generator=g)}


def test_keep_marks_a_stored_copy_used_without_copying():
    tier = WarmTier(1 << 20, pin=False)
    assert tier.put("a", _tensors(0)) and tier.put("b", _tensors(1))
    ptr = tier.get("a")["w"].data_ptr()
    assert tier.models() == ["b", "a"]
    assert tier.keep("b", _tensors(5))  # same layout: kept as stored, now most recently used
    assert tier.models() == ["a", "b"] and tier.get("a")["w"].data_ptr() == ptr
    assert not tier.keep("a", _tensors(0, rows=9))  # another shape: the caller must put
    assert not tier.keep("missing", _tensors(0))


def test_notes_go_with_their_entry():
    tier = WarmTier(1 << 20, pin=False)
    assert not tier.note("a", "shape", 1) and tier.noted("a", "shape") is None
    tier.put("a", _tensors(0))
    assert tier.note("a", "shape", 123) and tier.noted("a", "shape") == 123
    assert tier.noted("a", "other") is None
    assert tier.keep("a", _tensors(0)) and tier.noted("a", "shape") == 123
    tier.put("a", _tensors(1))  # a new copy: what was measured with the old one is gone
    assert tier.noted("a", "shape") is None
    tier.note("a", "shape", 7)
    tier.discard("a")
    assert tier.noted("a", "shape") is None

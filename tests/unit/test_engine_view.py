"""The admin status view of the engine's records: the keys and their order as the engine's maps
had them, a feature's figures only for a model that uses it (its flag), the memory split whole."""

from __future__ import annotations

import dataclasses
import json

from agent.http.admin_view import engine_row
from engine.stats import MemoryStats, ModelMemory
from tests.records import model_stats

BASE = ["running", "waiting", "kv_pages_used", "kv_pages_total", "device_bytes", "parked", "parked_s", "steps",
        "decode_graph_steps", "mixed_graph_steps", "host_s", "wait_s"]
PREFIX = ["prefix_cached_pages", "prefix_queried_tokens", "prefix_hit_tokens"]
CASCADE = ["cascade_rows", "cascade_steps", "cascade_long_rows"]
GRAMMAR = ["grammar_compiles", "grammar_cache_hits", "grammar_compile_s", "grammar_mask_s", "grammar_masked_rows",
           "grammar_masked_steps"]


def test_a_models_row_shows_the_figures_of_the_features_it_uses() -> None:
    assert list(engine_row(model_stats())) == BASE
    assert list(engine_row(model_stats(prefix_caching=True))) == BASE + PREFIX
    assert list(engine_row(model_stats(prefix_caching=True, cascade=True, constrained=True))) == (
        BASE + PREFIX + CASCADE + GRAMMAR)
    assert list(engine_row(model_stats(constrained=True))) == BASE + GRAMMAR
    row = engine_row(model_stats(running=2, yield_wait_s=0.25, prefix_caching=True, prefix_hit_tokens=64,
                                 constrained=True, grammar_compile_s=0.5, grammar_compiles=3))
    assert json.dumps(row) == (
        '{"running": 2, "waiting": 0, "kv_pages_used": 0, "kv_pages_total": 0, "device_bytes": 0, "parked": 0, '
        '"parked_s": 0.25, "steps": 0, "decode_graph_steps": 0, "mixed_graph_steps": 0, "host_s": 0.0, '
        '"wait_s": 0.0, "prefix_cached_pages": 0, "prefix_queried_tokens": 0, "prefix_hit_tokens": 64, '
        '"grammar_compiles": 3, "grammar_cache_hits": 0, "grammar_compile_s": 0.5, "grammar_mask_s": 0.0, '
        '"grammar_masked_rows": 0, "grammar_masked_steps": 0}')


def test_the_memory_split_keeps_its_keys() -> None:
    mem = MemoryStats(budget=100, used=60, free=40, weights=30, workspace=10, kv=20, kv_used=5, page_bytes=2, device=0,
                      kv_pages=10, kv_pages_free=7, untracked=0, models_omitted=1,
                      models={"a": ModelMemory(weights=1, workspace=2, kv_min=3, kv_used=4, kv_pages_used=5,
                                               kv_pages_total=6)})
    assert json.dumps(dataclasses.asdict(mem)) == (
        '{"budget": 100, "used": 60, "free": 40, "weights": 30, "workspace": 10, "kv": 20, "kv_used": 5, '
        '"page_bytes": 2, "kv_pages": 10, "kv_pages_free": 7, "untracked": 0, "device": 0, "models": {"a": {"weights": 1, "workspace": 2, '
        '"kv_min": 3, "kv_used": 4, "kv_pages_used": 5, "kv_pages_total": 6}}, "models_omitted": 1, '
        '"vacant": 0, "step": 0, "pool_resizes": 0, "pool_resize_s": 0.0}')

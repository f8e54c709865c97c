"""Engine records for tests that stand in for the engine (the worker's Status, a Loaded): every
field present, as the engine sends them, with the figures a test does not care about at 0."""

from __future__ import annotations

from typing import Any

from engine.stats import ModelStats

_ZERO = dict(running=0, waiting=0, kv_pages_used=0, kv_pages_total=0, device_bytes=0, yield_waits=0, yield_wait_s=0.0,
             prefix_caching=False, prefix_cached_pages=0, prefix_queried_tokens=0, prefix_hit_tokens=0,
             cascade=False, cascade_rows=0, cascade_steps=0, constrained=False, grammar_compiles=0,
             grammar_cache_hits=0, grammar_compile_s=0.0, grammar_mask_s=0.0, grammar_masked_rows=0,
             grammar_masked_steps=0, tokens_to_go=0, broken="", steps=0, decode_graph_steps=0, mixed_graph_steps=0,
             host_s=0.0, wait_s=0.0)


def model_stats(**figures: Any) -> ModelStats:
    """A model's engine row: ``figures`` over zeros (a feature's flag is not implied by its figures)."""
    return ModelStats(**{**_ZERO, **figures})

"""The numbers of a load that does not fit, for the worker's ``Error(op="load", code="no_room")``.

The agent decides evictions (it knows who is idle and who is pinned); the engine knows the
bytes. A ``Load`` offers the models the agent would evict, least recently used first; when the
engine refuses, :func:`refusal_details` answers with ``needed``, ``free``, ``evictable``,
``budget``, ``short`` (bytes) and ``evict``: the shortest prefix of the offer that makes room,
or ``[]`` when even evicting every offered model would not.

Two engines give these numbers: one whose refusal carries them (``LoadRefused`` of the
MemoryLedger: ``needed``, ``free``, ``budget`` and, when ``load_model`` was given the offer,
``evict``), and the tensor-parallel core (engine/parallel), whose models own their caches and
whose refusal is a plain ``EngineError``; for it alone the need is worked out here the way its
``load_model`` sizes a model (weights on the meta device, the step workspace, one longest
sequence of KV pages).
"""

from __future__ import annotations

from typing import Any

from engine.errors import LoadOptionError, ModelConfigError, WeightsError
from engine.load_spec import LoadSpec


def _estimate_need(core: Any, spec: LoadSpec) -> int:
    from engine.config import load_model_config, usable_len
    from engine.core.memory_plan import weight_bytes as model_weight_bytes
    from engine.core.memory_plan import workspace_estimate
    from engine.kv.kv_cache import KVSpec

    cfg = load_model_config(spec.model_dir)
    dtype = core.loader.dtype_for(cfg)
    weight_bytes = model_weight_bytes(cfg, dtype)
    max_len = usable_len(cfg, spec.max_model_len)
    opts = core.options
    workspace = workspace_estimate(cfg, opts.max_num_batched_tokens, spec.max_num_seqs)
    kv = KVSpec(cfg.num_layers, opts.block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
    return int(weight_bytes + workspace + -(-max_len // opts.block_size) * kv.page_bytes)


def accepts_evictable(core: Any) -> bool:
    """Whether ``core.load_model`` takes the offer itself (``evictable=``)."""
    import inspect

    try:
        return "evictable" in inspect.signature(core.load_model).parameters
    except (TypeError, ValueError):
        return False


def refusal_details(core: Any, exc: Exception, spec: LoadSpec, *, offered: list[str]) -> dict[str, Any] | None:
    """The refusal's numbers, or None when ``exc`` is not a refusal for lack of room."""
    if isinstance(exc, (ModelConfigError, WeightsError, LoadOptionError)):
        return None
    from engine.parallel.engine import TPEngineCore

    sizes = {name: s.device_bytes for name, s in core.stats().items()}
    if all(hasattr(exc, a) for a in ("needed", "free", "budget")):
        needed, free, budget = int(exc.needed), int(exc.free), int(exc.budget)
    elif not isinstance(core, TPEngineCore):
        # The ledger's engine refuses for room only with its numbers (LoadRefused): any other
        # failure (a CUDA error in a capture, say) is that failure, never "no room" (on the H200
        # one was reported as a refusal against "a 0 B budget", the config's fraction as bytes).
        return None
    else:
        budget = core.pools.ledger.budget if core.budget is not None else None
        if budget is None:
            return None
        try:
            needed = _estimate_need(core, spec)
        except Exception:  # config or weights unreadable: the load failed for that, not for room
            return None
        free = int(budget) - sum(sizes.values())
        if needed <= free:
            return None  # it would fit: this refusal is about something else
    if hasattr(exc, "evict") and hasattr(exc, "evictable_models"):
        # The ledger planned against the offer itself (the worker passed it to load_model).
        return {"needed": needed, "free": free, "evictable": int(exc.evictable), "budget": budget,
                "short": max(0, int(exc.short)), "evict": [str(m) for m in exc.evict]}
    offer = [m for m in offered if m in sizes]
    evict: list[str] = []
    room = free
    for name in offer:
        if room >= needed:
            break
        evict.append(name)
        room += sizes[name]
    evictable = sum(sizes[m] for m in offer)
    return {"needed": needed, "free": free, "evictable": evictable, "budget": int(budget),
            "short": max(0, needed - free - evictable), "evict": evict if room >= needed else []}

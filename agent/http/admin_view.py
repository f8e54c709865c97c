"""What the admin API answers with: a model's row, the engine's row of a model, the agent's status.

JSON built from the typed records (the manager's :class:`~agent.manager.entries.ModelEntry`, the
worker's :class:`~agent.worker.client.WorkerState` with the engine's
:class:`~engine.stats.ModelStats` and :class:`~engine.stats.MemoryStats`, a loaded model's
:class:`~engine.model_info.ModelInfo`). The manager keeps no view code; the CLI's ``status``
renders these shapes (agent/commands/status.py), so their keys are the admin API's contract.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import agent
from agent.context import AgentContext
from agent.manager.entries import ModelEntry, State
from agent.manager.manager import ModelManager
from engine.stats import ModelStats


def model_view(mgr: ModelManager, e: ModelEntry) -> dict[str, Any]:
    """One model as ``/admin/v1/models`` lists it: its state, and its engine figures once ready."""
    st = mgr.worker.state
    # The engine's row of a ready model: none before it is ready, nor while the last Status
    # describes its load before (its Loaded info has the bytes and pages then).
    s = st.models.get(e.name) if e.state is State.READY and e.name not in st.stale_models else None
    info = e.info
    if s is not None:
        device_bytes, pages_total = s.device_bytes, s.kv_pages_total
    elif info is not None:
        device_bytes, pages_total = info.device_bytes, info.kv_pages
    else:
        device_bytes, pages_total = 0, 0
    live = s is not None
    return {
        "name": e.name, "state": e.state.value, "reason": e.reason or None,
        "device_bytes": device_bytes,
        "kv_pages": {"used": s.kv_pages_used if live else 0, "total": pages_total,
                     "prefix_cached": s.prefix_cached_pages if live else 0},
        "prefix_cache": ({"enabled": True, "queried_tokens": s.prefix_queried_tokens if live else 0,
                          "hit_tokens": s.prefix_hit_tokens if live else 0,
                          "cascade_rows": s.cascade_rows if live else 0}
                         if e.settings.prefix_caching else {"enabled": False}),
        "running": s.running if live else 0, "waiting": s.waiting if live else 0,
        "in_flight": e.in_flight, "last_used": e.last_used, "load_seconds": e.load_seconds,
        "preempted": e.preempted,  # of in_flight: paused, waiting for this model's comeback
        "max_model_len": info.max_model_len if info is not None else e.settings.max_model_len,
        "quantization": e.effective("quantization"), "kv_cache_dtype": e.effective("kv_cache_dtype"),
        "vocab_size": info.vocab_size if info is not None else None,
        "preload": e.settings.preload, "queue_limit": e.queue_limit, "pinned": e.pin,
        "autoload": mgr.autoload_enabled(e), "keep_alive_s": e.settings.keep_alive,
        "idle_s": round(e.idle_for(time.monotonic()), 3) if e.state is State.READY else None,
        "unload_in_s": _unload_in(e),
        "refusal": e.refusal or None,
        # loads in a row that failed on their own, and the seconds before a request may retry
        # (LOAD_RETRY_S; an operator's load goes at once)
        "failed_loads": e.failed_loads,
        "retry_in_s": round(e.retry_in(), 3) or None,
        "snapshot": str(e.snapshot) if e.snapshot is not None else None,
        # which published version the cache holds (its manifest's digest; None: none cached),
        # and whether its next load pulls first (a pull was asked while it was loaded)
        "version": mgr.source.version(e.name) if mgr.source is not None else None,
        "needs_pull": e.needs_pull,
        "pull": mgr.source.pull_progress(e.name) if e.state is State.PULLING and mgr.source else None,
    }


def _unload_in(e: ModelEntry) -> float | None:
    """Seconds until a ready model is unloaded for being idle (keep_alive left; it restarts with
    each request); None when it is not ready, pinned, never unloaded when idle, or busy."""
    if e.state is not State.READY or e.pin or e.settings.keep_alive < 0 or e.in_flight:
        return None
    return round(max(0.0, e.settings.keep_alive - e.idle_for(time.monotonic())), 3)


def models_view(mgr: ModelManager) -> list[dict[str, Any]]:
    """Every model the manager knows, by name."""
    return [model_view(mgr, e) for e in sorted(mgr.models.values(), key=lambda e: e.name)]


def engine_row(s: ModelStats) -> dict[str, Any]:
    """A model's engine figures in the status view: the prefix, cascade and grammar ones only for
    a model that uses the feature (its flag; the figures are 0 otherwise)."""
    row: dict[str, Any] = {"running": s.running, "waiting": s.waiting, "kv_pages_used": s.kv_pages_used,
                           "kv_pages_total": s.kv_pages_total, "device_bytes": s.device_bytes, "parked": s.yield_waits,
                           "parked_s": s.yield_wait_s, "steps": s.steps, "decode_graph_steps": s.decode_graph_steps,
                           "mixed_graph_steps": s.mixed_graph_steps, "host_s": s.host_s, "wait_s": s.wait_s}
    if s.prefix_caching:
        row.update(prefix_cached_pages=s.prefix_cached_pages, prefix_queried_tokens=s.prefix_queried_tokens,
                   prefix_hit_tokens=s.prefix_hit_tokens)
    if s.cascade:
        row.update(cascade_rows=s.cascade_rows, cascade_steps=s.cascade_steps, cascade_long_rows=s.cascade_long_rows)
    if s.constrained:
        row.update(grammar_compiles=s.grammar_compiles, grammar_cache_hits=s.grammar_cache_hits,
                   grammar_compile_s=s.grammar_compile_s, grammar_mask_s=s.grammar_mask_s,
                   grammar_masked_rows=s.grammar_masked_rows, grammar_masked_steps=s.grammar_masked_steps)
    return row


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def status_view(ctx: AgentContext, ready: bool) -> dict[str, Any]:
    """``/admin/v1/status``: the agent, its worker, the budget, the disk cache, every model and
    what the engine itself holds. ``ready``: the readiness probe's answer (agent/http/health.py)."""
    w = ctx.worker.state
    now = time.monotonic()
    cache = ctx.manager.source.stats() if ctx.manager.source is not None else {}
    return {
        "version": agent.__version__,
        "pid": os.getpid(),
        "uptime_s": round(now - ctx.started, 3),
        "ready": ready,
        "draining": ctx.draining,
        # Where the OpenAI API listens, as configured (the address clients use).
        "listen": f"http://{_url_host(ctx.settings.server.host)}:{ctx.settings.server.port}",
        "worker": {
            "pid": ctx.worker.pid, "alive": w.alive, "device": w.device, "engine_error": w.engine_error or None,
            "restarts": w.restarts, "last_exit": w.last_exit or None, "steps": w.steps, "phase": w.phase,
            "heartbeat_age_s": round(now - w.last_frame, 3) if w.alive else None,
        },
        "budget": ctx.budget(),
        "cache": {"max_bytes": int(cache.get("max_bytes", ctx.settings.cache.max_bytes)),
                  "used_bytes": int(cache.get("used_bytes", 0)), "dir": str(ctx.settings.cache.dir)},
        # Where this agent pulls from: `infire-agent publish` with no store set publishes here.
        "store": ctx.settings.store.model_dump(),
        "models": models_view(ctx.manager),
        # The worker's last EngineCore.stats(): what the engine itself holds, per model.
        "engine": {"models": {name: engine_row(s) for name, s in w.models.items()},
                   "kv_pages_used": sum(s.kv_pages_used for s in w.models.values()),
                   # the ledger's split in bytes (Status.memory)
                   "memory": dataclasses.asdict(w.memory) if w.memory is not None else None,
                   # the warm tier's host bytes (Status.warm_tier): budget, ready (pinned so far), used
                   "warm_tier": dataclasses.asdict(w.warm_tier) if w.warm_tier is not None else None},
        # The start from exec to ready by phase, seconds since the agent's exec (agent/startup.py).
        "startup": ctx.startup_record(),
    }

"""The multi-model bench's setup: model folders, the budget plan, engine counters, small stats.

The plan is computed with the engine's public planning call only (``EngineCore.check_load`` on an
engine that loads nothing): the KV page size is the difference of two needs that differ only in
``num_kv_pages``; the big models get their KV reserved (``num_kv_pages``: their minimum and their
cap), so the budget that holds A and B holds their KV too, and C cannot borrow it.
"""

from __future__ import annotations

import argparse

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.core.engine_core import EngineCore
from engine.options import EngineOptions
from engine.core.ledger import LoadRefused
from engine.load_spec import LoadSpec

GIB = 1 << 30


def make_models(work: Path, arch: str, preset: str, small_arch: str, small_preset: str) -> dict[str, Path]:
    """A and B (same shape, different seeds) and C, generated once under ``work``."""
    from modelgen.make import make_model

    out = {}
    for name, (a, p, seed) in {"A": (arch, preset, 0), "B": (arch, preset, 1),
                               "C": (small_arch, small_preset, 2)}.items():
        d = work / f"{name}-{a}-{p}-s{seed}"
        if not (d / "config.json").is_file():
            make_model(d, a, p, seed=seed, device="cpu")
        out[name] = d
    return out


def _needed(core: EngineCore, name: str, d: Path, max_len: int, seqs: int, kv_pages: int | None = None) -> int:
    """Bytes a load needs (weights + workspace estimate + guaranteed KV), whether or not it fits."""
    try:
        return core.check_load(LoadSpec(name, d, max_len, seqs, num_kv_pages=kv_pages)).needed
    except LoadRefused as e:
        return e.needed


@dataclass
class Plan:
    page_bytes: int  # of the shared pool (set by A's geometry, as the engine's first load does)
    seq_pages: int  # pages one max_model_len sequence of A takes
    kv_pages: int  # reserved per big model (its minimum and its cap)
    needs: dict[str, int]  # bytes per model, C at its default minimum (one sequence)
    budget: int
    rule: str

    def as_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["kv_bytes_per_big_model"] = self.kv_pages * self.page_bytes
        d["kv_tokens_per_big_model"] = None  # filled from ModelInfo.block_size after the load
        return d


def plan_budget(a: argparse.Namespace, dirs: dict[str, Path]) -> Plan:
    """Page size, KV reserved per big model, and a budget that holds A and B but not C beside them."""
    seqs, max_len = a.max_num_seqs, a.max_model_len
    probe = EngineCore(EngineOptions(max_num_batched_tokens=a.max_num_batched_tokens),
                       device=a.device, budget=a.probe_budget)
    n0 = _needed(probe, "A", dirs["A"], max_len, seqs)
    n1 = _needed(probe, "A", dirs["A"], max_len, seqs, kv_pages=max_len)  # max_len pages hold a sequence
    n2 = _needed(probe, "A", dirs["A"], max_len, seqs, kv_pages=2 * max_len)
    page_bytes = (n2 - n1) // max_len
    seq_pages = max_len - (n1 - n0) // page_bytes
    if a.kv_gib is not None:
        kv_pages = max(seq_pages, int(a.kv_gib * GIB) // page_bytes)
    else:
        kv_pages = seq_pages * seqs  # room for max_num_seqs longest sequences: never short
    # Later models take the pool's page size; an engine with page_bytes set plans as one that has A.
    probe = EngineCore(EngineOptions(max_num_batched_tokens=a.max_num_batched_tokens, page_bytes=page_bytes),
                       device=a.device, budget=a.probe_budget)
    needs = {n: _needed(probe, n, dirs[n], max_len, seqs, kv_pages=kv_pages) for n in ("A", "B")}
    needs["C"] = _needed(probe, "C", dirs["C"], max_len, seqs)
    del probe
    if a.budget:
        return Plan(page_bytes, seq_pages, kv_pages, needs, a.budget, "given (--budget)")
    budget = needs["A"] + needs["B"] + needs["C"] // 2
    return Plan(page_bytes, seq_pages, kv_pages, needs, budget,
                "needs(A) + needs(B) + needs(C) // 2: A and B fit with their reserved KV, C does not")


def engine_counters(core: EngineCore) -> dict[str, dict[str, Any]]:
    """Per model: engine steps, graph-replayed steps, runner host/wait seconds, decode buckets not
    yet captured. Diagnostics read from the engine's internals, defensively: {} when absent."""
    out: dict[str, dict[str, Any]] = {}
    for name, slot in core.slots.items():
        r = getattr(slot, "runner", None)
        g = getattr(r, "graphs", None)
        mixed = getattr(r, "mixed", None)
        out[name] = {"steps": getattr(slot, "steps", 0),
                     "graph_steps": getattr(r, "graph_steps", 0) + getattr(r, "mixed_graph_steps", 0),
                     "mixed_graph_steps": getattr(r, "mixed_graph_steps", 0),
                     "deferred_mixed_graphs": sorted(getattr(mixed, "deferred", ()) or ()),
                     "host_s": getattr(r, "host_seconds", 0.0), "wait_s": getattr(r, "wait_seconds", 0.0),
                     "runner": id(r),
                     "deferred_graphs": sorted(getattr(g, "deferred", ()) or ()),
                     "graphs": len(getattr(g, "graphs", ()) or ())}
    return out


def counter_delta(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]],
                  wall: float) -> dict[str, Any]:
    """Engine steps of a phase per model and in all, mean wall per engine step (ms), host ms per step."""
    per: dict[str, Any] = {}
    for name, b in before.items():
        x = after.get(name)
        if x is None:
            continue
        steps = x["steps"] - b["steps"]
        graph = x["graph_steps"] - b["graph_steps"]
        per[name] = {"steps": steps, "graph_steps": graph, "eager_steps": steps - graph,
                     "mixed_graph_steps": x["mixed_graph_steps"] - b["mixed_graph_steps"],
                     "deferred_mixed_graphs_before": b["deferred_mixed_graphs"],
                     "host_ms_per_step": (x["host_s"] - b["host_s"]) * 1e3 / steps if steps else None,
                     "wait_ms_per_step": (x["wait_s"] - b["wait_s"]) * 1e3 / steps if steps else None,
                     "runner_rebuilt": x["runner"] != b["runner"],
                     "deferred_graphs_before": b["deferred_graphs"], "graphs_before": b["graphs"]}
    total = sum(p["steps"] for p in per.values())
    return {"per_model": per, "steps": total, "wall_ms_per_step": wall * 1e3 / total if total else None}


def ratio(x: float | None, y: float | None) -> float | None:
    return x / y if x is not None and y else None

"""The state the HTTP handlers share: settings, metrics, the worker client, the model manager.

:mod:`agent.app` builds one :class:`AgentContext` and its lifecycle fills in the manager; the
handlers in :mod:`agent.http` read it and import nothing of the app.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from agent.config import Settings
from agent.manager.manager import ModelManager
from agent.metrics import Metrics
from agent.startup import StartupRecord
from agent.systemd import Notifier
from agent.worker.client import WorkerClient
from agent.http.structured import GrammarBuilder


@dataclass
class AgentContext:
    settings: Settings
    metrics: Metrics
    worker: WorkerClient
    notifier: Notifier
    engine: str = "core"
    started: float = field(default_factory=time.monotonic)
    started_wall: float = field(default_factory=time.time)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)  # set when it drains: wakes waiting admin calls
    manager: ModelManager = None  # type: ignore[assignment]  # set by the manager context
    startup: StartupRecord = field(default_factory=StartupRecord)  # made first: its clock starts here
    grammars: GrammarBuilder = field(default_factory=GrammarBuilder)  # response_format → grammar, cached

    @property
    def draining(self) -> bool:
        """The agent is stopping: new requests get 503, and admin calls waiting for an
        operation answer now (a load still pulling when the agent stops is called off)."""
        return self.stopping.is_set()

    @draining.setter
    def draining(self, on: bool) -> None:
        if on:
            self.stopping.set()
        else:
            self.stopping.clear()

    def startup_record(self, freeze: bool = False) -> dict[str, Any]:
        """The start's phases up to now (``freeze``: at ready, kept from then on)."""
        preload = [self.manager.models[m.name] for m in self.settings.models
                   if m.preload and m.name in self.manager.models] if self.manager is not None else []
        how = self.startup.freeze if freeze else self.startup.compose
        return how(self.worker.state, self.worker.load_timings, preload)

    def budget(self) -> dict[str, Any]:
        g = self.settings.gpu
        total: int | None = self.worker.state.budget_bytes or None  # what the engine works with
        if total is None and isinstance(g.memory_budget, int):
            total = int(g.memory_budget)
        mem = self.worker.state.memory
        # The ledger's use (weights, workspaces, the whole KV pool, what the device holds beyond
        # the books); before the worker has said, what its models hold.
        used = mem.used if mem is not None else sum(s.device_bytes for s in self.worker.state.models.values())
        out: dict[str, Any] = {"total_bytes": total, "used_bytes": used,
                               "device_bytes": mem.device if mem is not None else None,
                               "pool_resizes": mem.pool_resizes if mem is not None else None,
                               "pool_resize_s": mem.pool_resize_s if mem is not None else None}
        # Who holds ``used`` (engine/stats.py, MemoryStats): what decides how many models fit
        for key, field in (("weights_bytes", "weights"), ("workspace_bytes", "workspace"), ("step_bytes", "step"),
                           ("vacant_bytes", "vacant"), ("kv_pool_bytes", "kv"), ("untracked_bytes", "untracked")):
            out[key] = getattr(mem, field) if mem is not None else None
        if isinstance(g.memory_budget, float):
            out["fraction"] = g.memory_budget
        return out

"""The daemon's start, from exec to ready, as phases on one axis: seconds since the agent's exec.

The agent marks its own phases (imports and config up to the app being built, then the HTTP
listeners); the worker client keeps when the worker was spawned and said Hello, with the
worker's own phases from ``Hello.startup`` (seconds since *its* exec, placed here from the
moment its exec was asked for); each preload model's entry keeps its last load's steps (pull,
verify, load with the engine's ``Loaded.timings`` as its parts, tokenizer, canary). Nothing is
measured on the request path: the record is composed from those facts when asked (admin
status), and frozen once the daemon is ready.
"""

from __future__ import annotations

import time
from typing import Any

from engine.worker.protocol import exec_monotonic


class StartupRecord:
    """Phases ``{"name", "start_s", "seconds"}`` (plus ``model`` for a model's step, ``parts``
    for its load), ordered by start, and ``ready_s``: when the last preload model was ready."""

    def __init__(self) -> None:
        self._exec = exec_monotonic()  # the agent's exec
        self._agent: list[dict[str, Any]] = []
        self._last = self._exec
        self.frozen: dict[str, Any] | None = None
        self.mark("agent_start")  # interpreter, imports, settings: up to the app being built

    def since_exec(self, mono: float) -> float:
        return round(mono - self._exec, 6)

    def mark(self, name: str) -> None:
        """End the agent's phase that began at its previous mark."""
        now = time.monotonic()
        self._agent.append(_phase(name, self.since_exec(self._last), now - self._last))
        self._last = now

    def compose(self, worker: Any, load_timings: dict[str, dict[str, float]], models: list[Any]) -> dict[str, Any]:
        """The record now (frozen once :meth:`freeze` ran): ``worker`` is the WorkerState, ``models``
        the preload models' entries (``name``, ``phases``)."""
        if self.frozen is not None:
            return self.frozen
        phases = list(self._agent)
        ends: list[float] = []
        if worker.spawn_at:
            phases.append(_phase("worker_spawn", self.since_exec(worker.spawn_at), worker.spawned_at - worker.spawn_at))
            base = self.since_exec(worker.spawn_at)
            phases += [_phase(f"worker_{name}", base + start, seconds) for name, start, seconds in worker.startup]
        if worker.hello_at:
            phases.append(_phase("worker_hello", self.since_exec(worker.spawned_at), worker.hello_at - worker.spawned_at))
            ends.append(self.since_exec(worker.hello_at))
        for e in models:
            for step, (start, end) in e.phases.items():
                p = _phase(f"model_{step}", self.since_exec(start), end - start)
                p["model"] = e.name
                if step == "load" and e.name in load_timings:
                    p["parts"] = {k: round(v, 6) for k, v in load_timings[e.name].items()}
                phases.append(p)
                ends.append(self.since_exec(end))
        phases.sort(key=lambda p: p["start_s"])
        ready = max(ends) if ends and worker.hello_at else None
        return {"phases": phases, "ready_s": round(ready, 6) if ready is not None else None}

    def freeze(self, worker: Any, load_timings: dict[str, dict[str, float]], models: list[Any]) -> dict[str, Any]:
        """The record at ready, kept from then on (later loads and worker restarts do not change it)."""
        self.frozen = self.compose(worker, load_timings, models)
        return self.frozen


def _phase(name: str, start_s: float, seconds: float) -> dict[str, Any]:
    return {"name": name, "start_s": round(start_s, 6), "seconds": round(max(0.0, seconds), 6)}

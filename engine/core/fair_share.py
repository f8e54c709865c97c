"""Which model runs the next engine step: weighted fair share of measured GPU time.

EngineCore runs one model per step. ``FairSharePicker`` keeps a *virtual time* per model: after
a step that took ``d`` seconds on model ``m``, ``vtime[m] += d / weight[m]``. Each pick serves,
among the models that have work, the one with the smallest virtual time, so over any busy period
model ``m`` receives GPU time in proportion to its weight, measured rather than assumed (a
prefill-heavy step costs what it really cost).

A model that idles does not bank credit: when it becomes busy again its virtual time is raised to
the smallest virtual time among models that stayed busy (or to the picker's clock when none
did), so it competes from "now" instead of monopolising the GPU until it has caught up.

Pure Python, no torch, O(models) per pick. Not thread-safe: one engine thread owns it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from engine.errors import EngineError


class FairShareError(EngineError):
    """A bad weight, an unknown or duplicate model, or a bad step duration."""


@dataclass
class _Entry:
    weight: float
    vtime: float = 0.0
    busy: bool = False  # had work at the previous pick
    last_run: int = -1  # pick sequence number of its last run, for tie-breaking
    gpu_seconds: float = 0.0  # measured time charged to it, for stats and tests


def _check_weight(model: str, weight: float) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise FairShareError(f"weight of {model!r} must be a number, got {weight!r}")
    w = float(weight)
    if not math.isfinite(w) or w <= 0:
        raise FairShareError(f"weight of {model!r} must be finite and > 0, got {weight!r}")
    return w


class FairSharePicker:
    """The step picker: ``pick(models_with_work)`` then ``charge(model, seconds)`` after the step.

    ``add_model(name, weight)`` on load, ``remove_model(name)`` on unload, ``set_weight`` when the
    config changes. ``pick`` returns ``None`` when no model has work.
    """

    def __init__(self) -> None:
        self._models: dict[str, _Entry] = {}
        self._clock = 0.0  # monotonic floor for models that wake when nothing else is busy
        self._seq = 0

    # -- membership ---------------------------------------------------------------------------
    def add_model(self, model: str, weight: float = 1.0) -> None:
        if model in self._models:
            raise FairShareError(f"model {model!r} is already in the picker")
        # A newly loaded model starts at the clock, like one waking from idle.
        self._models[model] = _Entry(weight=_check_weight(model, weight), vtime=self._clock)

    def remove_model(self, model: str) -> None:
        self._entry(model)
        del self._models[model]

    def set_weight(self, model: str, weight: float) -> None:
        self._entry(model).weight = _check_weight(model, weight)

    def __contains__(self, model: object) -> bool:
        return model in self._models

    # -- the two calls of every step ------------------------------------------------------------
    def pick(self, models_with_work: Iterable[str]) -> str | None:
        """The model to run this step, among ``models_with_work`` (unknown names raise)."""
        ready = set(models_with_work)
        for name in ready:
            self._entry(name)
        if not ready:
            for e in self._models.values():
                e.busy = False
            return None
        # The floor a waking model is raised to: the least-served model that stayed busy.
        floor = min((e.vtime for n, e in self._models.items() if e.busy and n in ready), default=None)
        if floor is None:
            floor = self._clock
        best_name: str | None = None
        best: _Entry | None = None
        for name, e in self._models.items():
            if name not in ready:
                e.busy = False
                continue
            if not e.busy:
                e.vtime = max(e.vtime, floor)
                e.busy = True
            # Ties go to the model that ran least recently, so equal shares alternate.
            if best is None or (e.vtime, e.last_run) < (best.vtime, best.last_run):
                best_name, best = name, e
        if best is None:  # unreachable: ready is non-empty and every name in it is known
            return None
        self._clock = max(self._clock, best.vtime)
        self._seq += 1
        best.last_run = self._seq
        return best_name

    def charge(self, model: str, seconds: float) -> None:
        """Charge a step's measured duration to the model that ran it."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise FairShareError(f"step duration must be a number, got {seconds!r}")
        if not math.isfinite(seconds) or seconds < 0:
            raise FairShareError(f"step duration must be finite and >= 0, got {seconds!r}")
        e = self._entry(model)
        e.vtime += seconds / e.weight
        e.gpu_seconds += seconds

    # -- introspection --------------------------------------------------------------------------
    def virtual_time(self, model: str) -> float:
        return self._entry(model).vtime

    def gpu_seconds(self, model: str) -> float:
        """Total measured step time charged to ``model`` since it was added."""
        return self._entry(model).gpu_seconds

    def _entry(self, model: str) -> _Entry:
        try:
            return self._models[model]
        except KeyError:
            raise FairShareError(f"model {model!r} is not in the picker") from None

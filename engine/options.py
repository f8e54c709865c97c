"""The engine's behaviour switches and their defaults, in one place.

:class:`EngineOptions` is what the daemon's ``[engine]`` settings (agent/config.py
``EngineSettings``, whose defaults are read from here) hand the worker, and what
:class:`engine.core.engine_core.EngineCore` falls back on when a caller leaves an option out.
Torch-free, so the agent can import it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.errors import EngineError


@dataclass(frozen=True)
class EngineOptions:
    """``max_num_batched_tokens``: the most tokens one step takes (4096: the serving, latency
    shape measured on the H200, docs/perf.md; offline runs may take more).
    ``page_bytes``: the shared KV pool's page size; None: the first load sets it to its
    ``block_size`` tokens of that model.
    ``cuda_graphs``: capture CUDA graphs (decode and mixed steps); False: every step runs eagerly.
    ``async_steps``: on CUDA, launch step N+1 before collecting step N (a CPU step runs to
    completion at launch anyway).
    ``shared_step_tokens``: while another model is active, no step takes more tokens than this
    (0: no cap), so a quiet model's new request waits for at most one short step of another.
    ``quiet_window_ms``: while a model with at most a quarter of a busy model's requests had one
    within this window, the busy model's steps are not launched ahead (0: off): the quiet model's
    new prompt runs without the busy model's next step beside it; a model's "active" for the cap
    above lasts as long. 512 tokens with a 1000 ms window kept a quiet model's TTFT within 2x of
    solo next to 512 requests in flight, both models saturated at 0.99x and light load at >= 0.97x
    (H200, docs/perf.md; docs/multi-model.md has the rules).
    """

    max_num_batched_tokens: int = 4096
    page_bytes: int | None = None
    cuda_graphs: bool = True
    async_steps: bool = True
    shared_step_tokens: int = 512
    quiet_window_ms: int = 1000

    def __post_init__(self) -> None:
        _int(self, "max_num_batched_tokens", 1, 1 << 20)
        if self.page_bytes is not None:
            _int(self, "page_bytes", 1, 1 << 40)
        _bool(self, "cuda_graphs")
        _bool(self, "async_steps")
        _int(self, "shared_step_tokens", 0, 1 << 20)
        _int(self, "quiet_window_ms", 0, 60_000)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> EngineOptions:
        """The options named in ``raw`` (a missing one keeps its default; other keys are ignored:
        the worker's options carry more than the engine's)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})

    @property
    def quiet_window_s(self) -> float:
        return self.quiet_window_ms / 1000


def _int(opts: EngineOptions, name: str, lo: int, hi: int) -> None:
    v = getattr(opts, name)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise EngineError(f"engine option {name} must be an integer in [{lo}, {hi}], got {v!r}")


def _bool(opts: EngineOptions, name: str) -> None:
    v = getattr(opts, name)
    if not isinstance(v, bool):
        raise EngineError(f"engine option {name} must be true or false, got {v!r}")

"""The engine's behaviour switches and their defaults, in one place.

:class:`EngineOptions` is what the daemon's ``[engine]`` settings (agent/config.py
``EngineSettings``, whose defaults are read from here) hand the worker, and what
:class:`engine.core.engine_core.EngineCore` is built with (``EngineCore(options, device, budget)``),
in the engine's units: the worker passes them through unchanged. Torch-free, so the agent can
import it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from engine.errors import EngineError


DTYPE_NAMES = ("float32", "float16", "bfloat16")  # what ``dtype`` may name (engine.core.loading.DTYPES)


@dataclass(frozen=True)
class EngineOptions:
    """Every switch of an :class:`~engine.core.engine_core.EngineCore`, in the engine's own units.

    The daemon's ``[engine]`` settings:

    ``max_num_batched_tokens``: the most tokens one step takes (4096: the serving, latency
    shape measured on the H200, docs/perf.md; offline runs may take more).
    ``decode_step_tokens``: the most work one step takes while it carries decodes (prompt
    chunks costed by their attention, engine/sched/scheduler.py): a running request's time per
    token while prompts prefill beside it. 1024: ~25 ms of an 8B's matmuls; beside eight 32k
    prompts the decodes' TPOT p50 was 38 ms on an H100 at 9a28399 (55 ms before long rows were
    split; 177 ms at 9871be8 on the H200; ops/gpu/long_context.sh's ``steps`` phase sweeps it:
    512 / 768 gave 42 / 46 ms before the split, docs/perf.md).
    ``page_bytes``: the shared KV pool's page size; None: the first load sets it to its
    ``block_size`` tokens of that model.
    ``cuda_graphs``: capture CUDA graphs (decode and mixed steps); False: every step runs eagerly.
    ``async_steps``: on CUDA, launch step N+1 before collecting step N (a CPU step runs to
    completion at launch anyway, so there it is off unless ``async_on_cpu``).
    ``shared_step_tokens``: while another model is active, no step takes more tokens than this
    (0: no cap), so a quiet model's new request waits for at most one short step of another.
    ``quiet_window_ms``: while a model with at most a quarter of a busy model's requests had one
    within this window, the busy model's steps are not launched ahead (0: off): the quiet model's
    new prompt runs without the busy model's next step beside it; a model's "active" for the cap
    above lasts as long. 512 tokens with a 1000 ms window kept a quiet model's TTFT within 2x of
    solo next to 512 requests in flight, both models saturated at 0.99x and light load at >= 0.97x
    (H200, docs/perf.md; docs/multi-model.md has the rules).

    The worker's (agent/worker/options.py gives them from other settings or paths):

    ``warm_tier_bytes``: host RAM kept for unloaded models' weights, so a reload is one device
    copy (0: off; engine/weights/warm_tier.py). ``load_notes_path``: a file where measured
    workspaces are kept across processes (engine/core/load_notes.py), so a restart's load skips
    its warm-up (None: this process only).

    What tests, benchmarks and the offline API choose (the daemon keeps these defaults):

    ``block_size``: tokens per KV page of a load that names none (the first load sizes the
    pool's pages with it). ``max_prefill_chunk``: the most prompt tokens of one sequence in a
    step (None: the step's whole budget). ``dtype``: one of ``DTYPE_NAMES`` (None: float32 on
    CPU, the checkpoint's half type on a GPU). ``seed``: of the stream the engine draws seeds
    from for requests that bring none (None: the system's randomness). ``decode_buckets``: the
    decode batch sizes padded to (None: the graph buckets on CUDA with graphs, else none).
    ``mixed_buckets``: the token counts of the mixed-step graphs (None: the runner's default).
    ``warmup``: run one largest-batch step at load to measure the workspace (None: on CUDA).
    ``prebuild_runner``: on a warm reload that skips the warm-up, build the runner beside the
    weights (engine/runner/prebuild.py; None: on CUDA; True: on CPU too). ``async_on_cpu``:
    ``async_steps`` on CPU as well (tests of the asynchronous path).
    """

    max_num_batched_tokens: int = 4096
    decode_step_tokens: int = 1024
    page_bytes: int | None = None
    cuda_graphs: bool = True
    async_steps: bool = True
    shared_step_tokens: int = 512
    quiet_window_ms: int = 1000
    warm_tier_bytes: int = 0
    load_notes_path: str | None = None
    block_size: int = 16
    max_prefill_chunk: int | None = None
    dtype: str | None = None
    seed: int | None = None
    decode_buckets: tuple[int, ...] | None = None
    mixed_buckets: tuple[int, ...] | None = None
    warmup: bool | None = None
    prebuild_runner: bool | None = None
    async_on_cpu: bool = False

    def __post_init__(self) -> None:
        _int(self, "max_num_batched_tokens", 1, 1 << 20)
        _int(self, "decode_step_tokens", 1, 1 << 20)
        if self.page_bytes is not None:
            _int(self, "page_bytes", 1, 1 << 40)
        _bool(self, "cuda_graphs")
        _bool(self, "async_steps")
        _int(self, "shared_step_tokens", 0, 1 << 20)
        _int(self, "quiet_window_ms", 0, 60_000)
        _int(self, "warm_tier_bytes", 0, 1 << 50)
        if isinstance(self.load_notes_path, os.PathLike):
            object.__setattr__(self, "load_notes_path", os.fspath(self.load_notes_path))
        if self.load_notes_path is not None and not isinstance(self.load_notes_path, str):
            raise EngineError(f"engine option load_notes_path must be a path or None, got {self.load_notes_path!r}")
        _int(self, "block_size", 1, 1 << 20)
        if self.dtype is not None and self.dtype not in DTYPE_NAMES:
            raise EngineError(f"engine option dtype must be one of {sorted(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.seed is not None:
            _int(self, "seed", -(1 << 63), 1 << 64)
        for name in ("decode_buckets", "mixed_buckets"):
            v = getattr(self, name)
            if v is not None:
                if not isinstance(v, (tuple, list)) or any(isinstance(b, bool) or not isinstance(b, int) or b < 1
                                                           for b in v):
                    raise EngineError(f"engine option {name} must be None or a list of integers >= 1, got {v!r}")
                object.__setattr__(self, name, tuple(v))
        for name in ("warmup", "prebuild_runner"):
            if getattr(self, name) is not None:
                _bool(self, name)
        _bool(self, "async_on_cpu")

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

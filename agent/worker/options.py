"""The engine worker's options, from the agent's settings: what ``python -m engine.worker``
gets as ``--options`` JSON (engine/worker/setup.py reads them, strictly for the engine's own
switches). Kept apart from the app so the serve command can start the worker before it
imports the HTTP side (agent/commands/serve.py)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from agent.config import Settings


def worker_options(settings: Settings) -> dict[str, Any]:
    g, e = settings.gpu, settings.engine
    budget = g.memory_budget if isinstance(g.memory_budget, int) else None
    fraction = g.memory_budget if isinstance(g.memory_budget, float) else None
    if g.device == "cpu" and budget is None:
        budget = g.cpu_memory_budget
    # With device "auto" the worker picks: a fraction of the GPU, or the CPU byte budget.
    return {"device": g.device, "max_num_batched_tokens": e.max_num_batched_tokens,
            "decode_step_tokens": e.decode_step_tokens,
            "memory_budget_bytes": budget, "memory_budget_fraction": fraction,
            "cpu_memory_budget_bytes": g.cpu_memory_budget, "sandbox": e.sandbox,
            "warm_tier_bytes": g.warm_tier_bytes,
            # engine.options.EngineOptions, one key per field (the worker checks them strictly)
            "cuda_graphs": e.cuda_graphs, "async_steps": e.async_steps, "page_bytes": e.page_bytes,
            "shared_step_tokens": e.shared_step_tokens, "quiet_window_ms": e.quiet_window_ms,
            # The worker writes only its runtime dir, Triton's compile cache, its load notes and its bytecode
            # under the cache dir.
            "sandbox_options": {"cache_dir": str(settings.cache.dir), "runtime_dir": str(settings.server.runtime_dir),
                                "read_write": [str(settings.cache.dir / "triton"), str(settings.cache.dir / "engine"),
                                               str(pycache_dir(settings))],
                                "parent_pid": os.getpid()}}


def pycache_dir(settings: Settings) -> Path:
    return settings.cache.dir / "pycache"


def worker_env(settings: Settings) -> dict[str, str]:
    """The worker's environment: the agent's, plus, where torch was installed without bytecode,
    Python's bytecode cached under the cache dir (``PYTHONPYCACHEPREFIX``, written even where
    ``PYTHONDONTWRITEBYTECODE`` is set). ``import torch`` compiled from source is seconds of every
    start: on the H200 machine, whose torch has no bytecode, 2.8-4.7 s of a 6-9 s restart
    (``worker_torch``), against ~1 s from bytecode. Where the installation has its bytecode (pip
    writes it), nothing changes: a prefix would make Python ignore it and compile everything once
    more, into the cache disk. An operator's own ``PYTHONPYCACHEPREFIX`` is kept."""
    env = dict(os.environ)
    if "PYTHONPYCACHEPREFIX" not in env and not has_bytecode("torch"):
        env["PYTHONPYCACHEPREFIX"] = str(pycache_dir(settings))
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def has_bytecode(module: str) -> bool:
    """Whether ``module``'s installed source has its compiled bytecode beside it (found without
    importing it); True for a module that is not there (nothing to compile)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return True
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return True
    return os.path.exists(importlib.util.cache_from_source(spec.origin))

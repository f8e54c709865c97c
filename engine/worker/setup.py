"""How the engine worker process sets itself up, in this order: the engine from the agent's
options (the CUDA context made, the budget fixed), then the sandbox around it (engine/worker/main.py's
``main`` calls both before its loop).

The options are the agent's ``worker_options`` (agent/worker/options.py): the engine's switches
(:class:`engine.options.EngineOptions`, checked strictly here) plus the device, the budget, the
warm tier and the sandbox's options."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any


def make_core(options: dict[str, Any], mark: Callable[[str], None] = lambda _name: None) -> tuple[Any, str, str]:
    """(core or None, device name, error text). ``mark(phase)`` is called as each phase of the
    start ends ("torch", "engine_imports", "engine_core"; the device's context is the caller's next)."""
    if options.get("engine") == "none":
        return None, "none", ""
    try:
        import torch

        mark("torch")
        from engine.kernels.triton_cache import set_triton_cache_dir

        notes = sweep = None
        if cache_dir := (options.get("sandbox_options") or {}).get("cache_dir"):
            triton_dir = set_triton_cache_dir(cache_dir)  # compiled kernels survive restarts
            # ... but a damaged one is compiled again. Beside the engine's imports: reading a few
            # hundred kernels' records takes ~0.2 s, and no kernel loads before the first load.
            sweep = threading.Thread(target=_sweep, args=(triton_dir,), name="triton-sweep", daemon=True)
            sweep.start()
            notes = Path(cache_dir) / "engine" / "load-notes.json"  # and measured workspaces too
        from engine.core.engine_core import EngineCore
        from engine.options import EngineOptions

        mark("engine_imports")
        opts = EngineOptions.from_dict(options)
        if sweep is not None:
            sweep.join()
        core = EngineCore(
            device=options.get("device", "auto"), max_num_batched_tokens=opts.max_num_batched_tokens,
            memory_budget_bytes=options.get("memory_budget_bytes"), page_bytes=opts.page_bytes,
            cuda_graphs=opts.cuda_graphs,
            async_steps=None if opts.async_steps else False,  # on: where steps run asynchronously (CUDA)
            shared_step_tokens=opts.shared_step_tokens or None, quiet_window_s=opts.quiet_window_s,
            warm_tier_bytes=int(options.get("warm_tier_bytes", 0)), load_notes_path=notes,
        )
        mark("engine_core")
        fraction = options.get("memory_budget_fraction")
        if core.device.type == "cuda":
            # CUDA context now (the sandbox follows); one torch thread: idle OpenMP workers spin.
            torch.set_num_threads(1)
            torch.zeros(1, device=core.device)
            torch.cuda.synchronize(core.device)
        if core.memory_budget_bytes is None and fraction and core.device.type == "cuda":
            # "90%" means of the whole device, fixed at start, not of whatever is free at each load.
            core.memory_budget_bytes = int(float(fraction) * torch.cuda.mem_get_info(core.device)[1])
        elif core.memory_budget_bytes is None and core.device.type == "cpu" and options.get("cpu_memory_budget_bytes"):
            core.memory_budget_bytes = int(options["cpu_memory_budget_bytes"])
    except Exception as e:  # report, do not crash-loop: the agent shows it in status
        return None, "none", f"{type(e).__name__}: {e}"
    return core, str(core.device), ""


def _sweep(triton_dir: str) -> None:
    from engine.kernels.triton_cache import sweep_triton_cache

    for line in sweep_triton_cache(triton_dir):
        print(f"engine.worker: triton cache: removed {line}", file=sys.stderr)


def confine(options: dict[str, Any]) -> None:
    """Apply the sandbox (when ``options["sandbox"]``) after the device is initialised; its report
    goes to stderr."""
    if not options.get("sandbox", False):
        return
    from sandbox import launch

    report = launch.confine_worker(**options.get("sandbox_options", {}))
    print(f"engine.worker: sandbox: {json.dumps(report.to_dict(), default=str)}", file=sys.stderr)

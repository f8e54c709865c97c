"""How the engine worker process sets itself up, in this order: the engine from the agent's
options (the CUDA context made, the budget fixed), then the sandbox around it (engine/worker/main.py's
``main`` calls both before its loop)."""

from __future__ import annotations

import json
import sys
from typing import Any


def make_core(options: dict[str, Any]) -> tuple[Any, str, str]:
    """(core or None, device name, error text)."""
    if options.get("engine") == "none":
        return None, "none", ""
    try:
        from engine.core.engine_core import EngineCore
        from engine.runner.cuda_graphs import set_triton_cache_dir

        if cache_dir := (options.get("sandbox_options") or {}).get("cache_dir"):
            set_triton_cache_dir(cache_dir)  # compiled kernels survive restarts
        core = EngineCore(
            device=options.get("device", "auto"), max_num_batched_tokens=int(options.get("max_num_batched_tokens", 4096)),
            memory_budget_bytes=options.get("memory_budget_bytes"),
            decode_buckets=None if options.get("cuda_graphs", True) else (),
            async_steps=None if options.get("async_steps", True) else False,
            shared_step_tokens=int(options.get("shared_step_tokens") or 0) or None,
            quiet_window_s=None if options.get("quiet_window_ms") is None else int(options["quiet_window_ms"]) / 1000,
            warm_tier_bytes=int(options.get("warm_tier_bytes", 0)),
        )
        fraction = options.get("memory_budget_fraction")
        if core.device.type == "cuda":
            import torch

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
    return core, str(getattr(core, "device", options.get("device", "auto"))), ""


def confine(options: dict[str, Any]) -> str:
    """Apply the sandbox after the device is initialised; '' or the reason it was skipped."""
    if not options.get("sandbox", False):
        return ""
    try:
        from sandbox import launch
    except ImportError:
        return "sandbox module unavailable"
    fn = getattr(launch, "confine_worker", None)
    if fn is None:
        return "sandbox.launch has no confine_worker"
    report = fn(**options.get("sandbox_options", {}))
    to_dict = getattr(report, "to_dict", None)
    print(f"engine.worker: sandbox: {json.dumps(to_dict() if to_dict else str(report), default=str)}", file=sys.stderr)
    return ""

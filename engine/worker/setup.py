"""How the engine worker process sets itself up, in this order: the engine from the agent's
options (the CUDA context made, the budget fixed), then the sandbox around it (engine/worker/main.py's
``main`` calls both before its loop).

The options are the agent's ``worker_options`` (agent/worker/options.py): the engine's switches
(:class:`engine.options.EngineOptions`, in the engine's units, checked strictly and passed on
unchanged) plus the device, the budget and the sandbox's options."""

from __future__ import annotations

import ctypes
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
    cache_dir = (options.get("sandbox_options") or {}).get("cache_dir")
    early = _EarlyDevice(str(options.get("device", "auto")),
                         Path(cache_dir) / "engine" / "triton-key.json" if cache_dir else None)
    early.start()  # beside torch's import, which does not need it
    try:
        import torch

        early.torch_imported.set()
        mark("torch")
        from cache.triton_cache import set_triton_cache_dir

        notes = None
        if cache_dir:
            # Compiled kernels survive restarts (the agent sweeps out damaged ones before our
            # first load: agent/worker/client.py), and so do measured workspaces.
            set_triton_cache_dir(cache_dir)
            notes = Path(cache_dir) / "engine" / "load-notes.json"
        from engine.core.engine_core import EngineCore, resolve_device
        from engine.options import EngineOptions

        mark("engine_imports")
        opts = EngineOptions.from_dict({**options, "load_notes_path": str(notes) if notes else None})
        early.opened.wait()
        device = resolve_device(str(options.get("device", "auto")))
        budget = options.get("memory_budget_bytes")
        if budget is None and device.type == "cuda":
            # "90%" means of the whole device (the ledger resolves a fraction against its total),
            # fixed at start, not of whatever is free at each load.
            budget = options.get("memory_budget_fraction") or None
        elif budget is None and device.type == "cpu" and options.get("cpu_memory_budget_bytes"):
            budget = int(options["cpu_memory_budget_bytes"])
        core = EngineCore(opts, device=device, budget=budget)
        mark("engine_core")
        if core.device.type == "cuda":
            # CUDA context now (the sandbox follows); one torch thread: idle OpenMP workers spin.
            torch.set_num_threads(1)
            torch.zeros(1, device=core.device)
            torch.cuda.synchronize(core.device)
    except Exception as e:  # report, do not crash-loop: the agent shows it in status
        return None, "none", f"{type(e).__name__}: {e}"
    return core, str(core.device), ""


class _EarlyDevice(threading.Thread):
    """What a CUDA worker's start can do beside its imports: open the device's context
    (:func:`open_cuda_context`, while torch is imported), then, once torch is, Triton's
    installation hash (engine/worker/triton_key.py: kept in ``key_file`` across restarts;
    while the engine's imports, the sandbox and the first load's booking run)."""

    def __init__(self, device: str, key_file: Path | None) -> None:
        super().__init__(name="early-device", daemon=True)
        self.device = device
        self.key_file = key_file
        self.opened = threading.Event()  # the context is open, or found impossible
        self.torch_imported = threading.Event()

    def run(self) -> None:
        try:
            ctx = open_cuda_context(self.device)
        finally:
            self.opened.set()
        if ctx is not None:
            self.torch_imported.wait()
            from engine.worker.triton_key import prime_triton

            prime_triton(self.key_file)


def cuda_index(device: str) -> int | None:
    """The CUDA device ordinal a device option names ("auto" and "cuda": 0), None for the others."""
    if device in ("auto", "cuda"):
        return 0
    head, _, index = device.partition(":")
    return int(index) if head == "cuda" and index.isdigit() else None


def open_cuda_context(device: str) -> int | None:
    """Initialise the CUDA driver and create ``device``'s primary context through the driver API
    (ctypes: no torch needed), so that it is made while ``import torch`` runs (~1.6 s of Python on
    the H200 machine, ctypes calls release the GIL) instead of after it, when the engine's first
    CUDA call would (~0.3 s). The runtime torch uses takes that same primary context. Returns its
    handle; None (nothing done) where there is no driver or device: torch then finds out and says so."""
    index = cuda_index(device)
    if index is None:
        return None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    if (lib.cuInit(0) == 0 and lib.cuDeviceGet(ctypes.byref(dev), index) == 0
            and lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0):
        return ctx.value
    return None


def confine(options: dict[str, Any]) -> None:
    """Apply the sandbox (when ``options["sandbox"]``) after the device is initialised; its report
    goes to stderr."""
    if not options.get("sandbox", False):
        return
    from sandbox import launch

    report = launch.confine_worker(**options.get("sandbox_options", {}))
    print(f"engine.worker: sandbox: {json.dumps(report.to_dict(), default=str)}", file=sys.stderr)

"""A restart's engine side in one fresh process, phase by phase: ``import torch``, the engine's
imports, the core and its CUDA context, then one model's load with the load notes and the Triton
cache a previous process left (what the worker does on a restart, without the agent).

Usage (GPU machine): ``python3 ops/gpu/restart_load_probe.py MODEL_DIR WORK_DIR OUT_JSON``; run it
twice with the same WORK_DIR (the first fills the Triton cache and the notes) and the second
under ``py-spy record --threads`` to see where the load's threads spend it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

t0 = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
work = Path(sys.argv[2])
os.environ["TRITON_CACHE_DIR"] = str(work / "triton")

import torch  # noqa: E402

t_torch = time.perf_counter()
from engine.core.engine_core import EngineCore  # noqa: E402
from engine.options import EngineOptions  # noqa: E402
from engine.load_spec import LoadSpec  # noqa: E402

t_imports = time.perf_counter()
opts = EngineOptions()
core = EngineCore(EngineOptions(max_num_batched_tokens=opts.max_num_batched_tokens,
                                load_notes_path=work / "load-notes.json"), device="cuda")
torch.zeros(1, device=core.device)
torch.cuda.synchronize()
t_core = time.perf_counter()
core.load_model(LoadSpec("m", sys.argv[1], max_model_len=4096, max_num_seqs=256))
torch.cuda.synchronize()
t_load = time.perf_counter()
report = {"import_torch_s": t_torch - t0, "engine_imports_s": t_imports - t_torch, "core_and_context_s": t_core - t_imports,
          "load_s": t_load - t_core, "load_timings": core.loader.last_load_timings}
Path(sys.argv[3]).write_text(json.dumps(report, indent=2))
print(json.dumps(report))

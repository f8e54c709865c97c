"""The worker's early CUDA context (engine/worker/setup.py ``open_cuda_context``): made through
the driver before torch is imported, it is the very context torch then runs in."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROBE = """
import ctypes, sys
from engine.worker.setup import open_cuda_context
ctx = open_cuda_context("cuda")
assert ctx, "no context"
assert "torch" not in sys.modules
import torch
x = torch.arange(8, device="cuda", dtype=torch.float32)
assert float(x.sum()) == 28.0
cur = ctypes.c_void_p()
assert ctypes.CDLL("libcuda.so.1").cuCtxGetCurrent(ctypes.byref(cur)) == 0
assert cur.value == ctx, (cur.value, ctx)
print("ok")
"""


def test_the_early_context_is_the_one_torch_uses() -> None:
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


PRIMED = """
import time
from engine.worker.setup import make_core
core, device, err = make_core({"engine": "core", "device": "cuda"})
assert core is not None and device.startswith("cuda"), err
from triton.runtime.cache import triton_key
deadline = time.monotonic() + 30
while triton_key.cache_info().currsize == 0 and time.monotonic() < deadline:
    time.sleep(0.01)
assert triton_key.cache_info().currsize == 1 and triton_key.cache_info().misses == 1
print("ok")
"""


def test_a_cuda_workers_start_hashes_tritons_installation_before_any_kernel() -> None:
    """The first kernel lookup of a process would otherwise hash Triton's installation first."""
    r = subprocess.run([sys.executable, "-c", PRIMED], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr

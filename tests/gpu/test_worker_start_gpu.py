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

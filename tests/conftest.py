"""Shared fixtures. Tests run on CPU with tiny generated models; tests/gpu skip without CUDA."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

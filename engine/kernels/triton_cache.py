"""Where Triton keeps its compiled kernels: under the agent's cache directory, so a restart finds
every kernel already compiled."""

from __future__ import annotations

import os
from pathlib import Path


def set_triton_cache_dir(cache_dir: str | os.PathLike) -> str:
    """Point Triton's compile cache at ``<cache_dir>/triton`` unless TRITON_CACHE_DIR is already set.

    Call before the first kernel compiles (the worker does it at start), so a restart finds
    every kernel compiled. Returns the directory in effect.
    """
    current = os.environ.get("TRITON_CACHE_DIR")
    if current:
        return current
    path = Path(cache_dir) / "triton"
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = str(path)
    return str(path)

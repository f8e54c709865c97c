"""A "sharp" copy of a model folder: q/k projections scaled up (other projections optionally too)
so attention is peaked and a wrong position, rope or mask changes the tokens (the oracle tests)."""

from __future__ import annotations

import shutil
from pathlib import Path


def sharpen(src: Path, dst: Path, qk_scale: float, proj_scale: float = 1.0) -> Path:
    """Copy ``src`` to ``dst`` with q_proj/k_proj weights × ``qk_scale`` and the other
    ``*proj.weight`` × ``proj_scale``; returns ``dst``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        t = load_file(f)
        for k in t:
            if k.endswith(("q_proj.weight", "k_proj.weight")):
                t[k] = t[k] * qk_scale
            elif proj_scale != 1.0 and k.endswith("proj.weight"):
                t[k] = t[k] * proj_scale
        save_file(t, f, metadata={"format": "pt"})
    return dst

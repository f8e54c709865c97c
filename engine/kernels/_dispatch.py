"""Backend choice for the kernels: Triton on CUDA tensors, the torch reference elsewhere.

``INFIRE_KERNELS=torch`` forces the references everywhere; ``INFIRE_KERNELS=triton`` forces the
Triton kernels (on CPU that only works under ``TRITON_INTERPRET=1``, which the tests use). A
debug escape hatch, read once, at the first kernel call; tests that flip it reset ``_forced``.
"""

from __future__ import annotations

import importlib.util
import os

import torch


class KernelError(ValueError):
    """Bad input to a kernel (shape, dtype, layout), or an unusable backend choice."""


_VALID = ("", "auto", "torch", "triton")

# INFIRE_KERNELS as read at the first call ("" or "auto": by device); None: not read yet.
_forced: str | None = None


def triton_available() -> bool:
    """True when the triton package can be imported (it may still lack a usable backend)."""
    return importlib.util.find_spec("triton") is not None


def forced_backend() -> str:
    """``INFIRE_KERNELS`` (``""``, ``auto``, ``torch`` or ``triton``), read once and kept."""
    global _forced
    if _forced is None:
        choice = os.environ.get("INFIRE_KERNELS", "").strip().lower()
        if choice not in _VALID:
            raise KernelError(f"INFIRE_KERNELS={choice!r}: expected torch, triton or auto")
        if choice == "triton" and not triton_available():
            raise KernelError("INFIRE_KERNELS=triton but triton is not installed")
        _forced = choice
    return _forced


def backend_for(*tensors: torch.Tensor) -> str:
    """Return ``"triton"`` or ``"torch"`` for a call on these tensors."""
    choice = forced_backend()
    if choice in ("torch", "triton"):
        return choice
    if tensors and all(t.is_cuda for t in tensors) and triton_available():
        return "triton"
    return "torch"


def use_triton(*tensors: torch.Tensor) -> bool:
    return backend_for(*tensors) == "triton"


def check(cond: bool, message: str) -> None:
    """Raise KernelError(message) unless cond holds (validation that survives ``python -O``)."""
    if not cond:
        raise KernelError(message)

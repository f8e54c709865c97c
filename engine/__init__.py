"""The data plane: EngineCore, scheduler, block manager, model runner, models, kernels.

``import engine`` stays light (no torch): the public names are resolved on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "SamplingParams", "SamplingParamsError", "EngineCore", "EngineError", "RequestError"]

_LAZY = {
    "LLM": ("engine.llm", "LLM"),
    "SamplingParams": ("engine.sampling", "SamplingParams"),
    "SamplingParamsError": ("engine.sampling", "SamplingParamsError"),
    "EngineCore": ("engine.core.engine_core", "EngineCore"),
    "EngineError": ("engine.errors", "EngineError"),
    "RequestError": ("engine.errors", "RequestError"),
}

if TYPE_CHECKING:  # pragma: no cover
    from engine.core.engine_core import EngineCore
    from engine.errors import EngineError, RequestError
    from engine.llm import LLM
    from engine.sampling import SamplingParams, SamplingParamsError


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(target[0]), target[1])

"""Typed errors of the engine (no torch import: the agent catches these by type)."""

from __future__ import annotations


class EngineError(Exception):
    """A request or a load was refused: bad input, unknown model, does not fit."""


class ModelConfigError(EngineError):
    """config.json is missing, malformed, or describes a model this engine does not run."""


class WeightsError(EngineError):
    """The weight files are missing, not safetensors, malformed or do not match the config."""

"""Typed errors of the engine (no torch import: the agent catches these by type)."""

from __future__ import annotations


class EngineError(Exception):
    """A request or a load was refused: bad input, unknown model, does not fit."""


class RequestError(EngineError):
    """A request was refused at ``add_request``; ``param`` names the offending input
    (``prompt_token_ids``, ``model``, ``req_id`` or a sampling field such as ``top_p``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotLoaded(RequestError):
    """The request names a model that is not loaded: never loaded, or unloaded since the agent
    admitted the request (an unload's drain that ended, or a grammar compile the unload cut)."""


class ModelConfigError(EngineError):
    """config.json is missing, malformed, or describes a model this engine does not run."""


class LoadOptionError(EngineError):
    """A load's option (quantization, KV cache dtype) is one this engine, model or device cannot
    run: the reason is the message; never a matter of room."""


class WeightsError(EngineError):
    """The weight files are missing, not safetensors, malformed or do not match the config."""

"""Typed errors of the model store and the disk cache.

Every failure the agent may show to an operator is one of these, with a message that names the
model, file or key concerned. ``retryable`` tells the downloader whether trying again can help.
"""

from __future__ import annotations


class CacheError(Exception):
    """Base of every error raised by ``cache``."""


class ManifestError(CacheError):
    """A manifest (or a name or path in it) is malformed or refused; nothing was written."""


class SafetensorsError(CacheError):
    """A safetensors header is malformed; the file must not be read as tensors."""


class IntegrityError(CacheError):
    """Downloaded or cached bytes do not match the manifest (digest or size)."""


class CacheFullError(CacheError):
    """The cache quota or the disk has no room for the model, even after eviction."""


class Aborted(CacheError):
    """A store call or download given up by its caller (a cancelled pull, a stopping agent)."""


class StoreError(CacheError):
    """The store failed an operation.

    ``retryable`` is True for throttling, server errors, resets, stalls and malformed ranged
    responses; ``retry_after`` carries a server-given delay in seconds (429/503 Retry-After).
    """

    def __init__(self, message: str, *, retryable: bool = False, retry_after: float | None = None,
                 status: int | None = None) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.retry_after = retry_after
        self.status = status


class NotFoundError(StoreError):
    """The key (a model's manifest or a blob) is not in the store."""


class ETagChangedError(StoreError):
    """The object changed while it was being read (If-Match failed or another ETag came back)."""


class ModelNotInStore(NotFoundError):
    """The store has no manifest under that model name: nothing was written for it."""

"""The model store interface: where blobs and manifests live, and what every store does.

Implementations: :class:`cache.s3_store.S3Store` (S3, R2, MinIO, moto) and
:class:`cache.file_store.FileStore` (a local folder); :func:`cache.store.open_store` picks one
from a URL. Layout under the store's prefix (docs/architecture.md, "Store")::

    blobs/sha256/<64 lowercase hex>       immutable file contents
    models/<name>/manifest.json           written last by publish

Every method is blocking (boto3 is); the agent calls them from worker threads. Errors come out as
:class:`StoreError` (``retryable`` set for throttling, 5xx, resets, stalls and malformed ranged
responses), :class:`NotFoundError` and :class:`ETagChangedError`; retries are the caller's policy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from cache.errors import NotFoundError
from cache.manifest import validate_digest, validate_name


@dataclass(frozen=True)
class ObjectInfo:
    size: int
    etag: str


class RangeReader(Protocol):
    """The body of a validated ranged read: exactly the requested bytes, or an error."""

    def readinto(self, buf: memoryview) -> int: ...
    def close(self) -> None: ...
    def interrupt(self) -> None:
        """End a read blocked in another thread (a cancelled download): it returns short or raises."""


def blob_key(digest: str) -> str:
    return f"blobs/sha256/{validate_digest(digest)}"


def manifest_key(name: str) -> str:
    return f"models/{validate_name(name)}/manifest.json"


class Store(ABC):
    """An object store holding blobs and manifests."""

    url: str

    @abstractmethod
    def head(self, key: str) -> ObjectInfo:
        """Size and ETag; raises NotFoundError."""

    @abstractmethod
    def get_bytes(self, key: str, max_bytes: int) -> bytes:
        """A whole small object (a manifest); raises NotFoundError, StoreError when too large."""

    @abstractmethod
    def open_range(self, key: str, start: int, end: int, etag: str, total: int) -> RangeReader:
        """Bytes ``[start, end)`` of an object whose ETag must still be ``etag`` and size ``total``.

        The response is checked before it is returned: a ranged answer (206) with the right
        Content-Range and length and the same ETag, else a retryable StoreError or
        ETagChangedError.
        """

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def put_file(self, key: str, path: Path, on_bytes: Callable[[int], None] | None = None) -> None:
        """Upload a local file (multipart when large)."""

    def exists(self, key: str) -> ObjectInfo | None:
        try:
            return self.head(key)
        except NotFoundError:
            return None

    def close(self) -> None:
        """Release connections."""

"""Model stores: S3-compatible object storage (R2, S3, MinIO, moto) and a local folder.

Layout under the store's prefix (DESIGN §4)::

    blobs/sha256/<64 lowercase hex>       immutable file contents
    models/<name>/manifest.json           written last by publish

Every method is blocking (boto3 is); the agent calls them from worker threads. Errors come out as
:class:`StoreError` (``retryable`` set for throttling, 5xx, resets, stalls and malformed ranged
responses), :class:`NotFoundError` and :class:`ETagChangedError`; retries are the caller's policy.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from cache.errors import ETagChangedError, NotFoundError, StoreError
from cache.manifest import validate_digest, validate_name


@dataclass(frozen=True)
class ObjectInfo:
    size: int
    etag: str


class RangeReader(Protocol):
    """The body of a validated ranged read: exactly the requested bytes, or an error."""

    def readinto(self, buf: memoryview) -> int: ...
    def close(self) -> None: ...


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


# ---------------------------------------------------------------- file store


def _file_etag(st: os.stat_result) -> str:
    return f"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"


class _FileRange:
    def __init__(self, f, remaining: int) -> None:
        self._f = f
        self._remaining = remaining

    def readinto(self, buf: memoryview) -> int:
        if self._remaining <= 0:
            return 0
        n = self._f.readinto(buf[: min(len(buf), self._remaining)])
        self._remaining -= n
        return n

    def close(self) -> None:
        self._f.close()


class FileStore(Store):
    """A store in a local folder (``file:///dir``): the embedded default and the test double."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.url = self.root.as_uri() if self.root.is_absolute() else f"file://{self.root}"

    def _path(self, key: str) -> Path:
        return self.root / key

    def head(self, key: str) -> ObjectInfo:
        try:
            st = self._path(key).stat()
        except FileNotFoundError:
            raise NotFoundError(f"{self.url}/{key} not found", status=404) from None
        return ObjectInfo(st.st_size, _file_etag(st))

    def get_bytes(self, key: str, max_bytes: int) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                data = f.read(max_bytes + 1)
        except FileNotFoundError:
            raise NotFoundError(f"{self.url}/{key} not found", status=404) from None
        if len(data) > max_bytes:
            raise StoreError(f"{self.url}/{key} is larger than {max_bytes} bytes")
        return data

    def open_range(self, key: str, start: int, end: int, etag: str, total: int) -> RangeReader:
        try:
            f = open(self._path(key), "rb", buffering=0)
        except FileNotFoundError:
            raise NotFoundError(f"{self.url}/{key} not found", status=404) from None
        st = os.fstat(f.fileno())
        if _file_etag(st) != etag or st.st_size != total:
            f.close()
            raise ETagChangedError(f"{self.url}/{key} changed while it was read", status=412)
        f.seek(start)
        return _FileRange(f, end - start)

    def put_bytes(self, key: str, data: bytes) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)

    def put_file(self, key: str, path: Path, on_bytes: Callable[[int], None] | None = None) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
        try:
            with open(path, "rb") as src, open(tmp, "wb") as out:
                while chunk := src.read(8 << 20):
                    out.write(chunk)
                    if on_bytes:
                        on_bytes(len(chunk))
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------- factory


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` → (bucket, prefix without slashes at either end)."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise StoreError(f"{url!r} is not an s3://bucket[/prefix] URL")
    if not re.match(r"^[a-z0-9][a-z0-9.-]{1,62}$", parsed.netloc):
        raise StoreError(f"{url!r}: {parsed.netloc!r} is not a bucket name")
    return parsed.netloc, parsed.path.strip("/")


def open_store(url: str, endpoint_url: str | None = None, region: str = "auto", path_style: bool = False,
               **s3_options) -> Store:
    """A Store for ``file:///dir`` or ``s3://bucket/prefix`` (endpoint_url for R2 and others).

    ``s3_options`` go to :class:`cache.s3_store.S3Store` (max_connections, connect_timeout,
    read_timeout — the stall timeout —, multipart_threshold, multipart_part_size, upload_concurrency).
    """
    if url.startswith("file://"):
        parsed = urllib.parse.urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise StoreError(f"{url!r}: a file store URL must be file:///absolute/path")
        return FileStore(urllib.parse.unquote(parsed.path))
    if url.startswith("s3://"):
        from cache.s3_store import S3Store

        bucket, prefix = parse_s3_url(url)
        return S3Store(bucket, prefix, endpoint_url=endpoint_url or None, region=region or "auto",
                       path_style=path_style, **s3_options)
    raise StoreError(f"{url!r}: the store URL must start with file:// or s3://")


def __getattr__(name: str):
    # ``cache.store.S3Store`` without importing boto3 for users of the file store.
    if name == "S3Store":
        from cache.s3_store import S3Store

        return S3Store
    raise AttributeError(name)

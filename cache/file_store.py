"""FileStore: a store in a local folder (``file:///dir``), the embedded default and the test double."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from cache.errors import ETagChangedError, NotFoundError, StoreError
from cache.object_store import ObjectInfo, RangeReader, Store


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

    def interrupt(self) -> None:
        """Nothing to end: a local file's read does not wait on anyone."""


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

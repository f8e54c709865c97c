"""A store from its URL: ``file:///dir`` or ``s3://bucket/prefix``."""

from __future__ import annotations

import re
import urllib.parse

from cache.errors import StoreError
from cache.file_store import FileStore
from cache.object_store import Store


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
        from cache.s3_store import S3Store  # here: users of the file store never import boto3

        bucket, prefix = parse_s3_url(url)
        return S3Store(bucket, prefix, endpoint_url=endpoint_url or None, region=region or "auto",
                       path_style=path_style, **s3_options)
    raise StoreError(f"{url!r}: the store URL must start with file:// or s3://")

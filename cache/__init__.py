"""Model store, manifests, downloader, verified disk cache and safetensors header check.

The agent's entry points::

    from cache import DiskCache, open_store
    store = open_store(url, endpoint_url, region, path_style)
    path = await DiskCache(dir, max_bytes).pull(store, name)
"""

from cache.disk_cache import DiskCache
from cache.downloader import DownloadConfig
from cache.errors import (CacheError, CacheFullError, ETagChangedError, IntegrityError, ManifestError,
                          NotFoundError, SafetensorsError, StoreError)
from cache.progress import Progress
from cache.retry import RetryPolicy
from cache.file_store import FileStore
from cache.object_store import ObjectInfo, Store
from cache.store import open_store

__all__ = [
    "CacheError", "CacheFullError", "DiskCache", "DownloadConfig", "ETagChangedError", "FileStore",
    "IntegrityError", "ManifestError", "NotFoundError", "ObjectInfo", "Progress", "RetryPolicy",
    "SafetensorsError", "Store", "StoreError", "open_store",
]

"""Model store, manifests, downloader, verified disk cache and safetensors header check.

The agent's entry points::

    from cache.disk_cache import DiskCache
    from cache.store import open_store
    store = open_store(url, endpoint_url, region, path_style)
    path = await DiskCache(dir, max_bytes).pull(store, name)

(Nothing is imported here: the CLI's commands import ``cache.sizes`` and must not pay for the disk
cache's logging and storage stacks.)
"""

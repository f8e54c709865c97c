"""Publish a model folder to a store: blobs first (skipped when present), the manifest last.

Readers find a model only through its manifest, so a publish that dies half-way leaves nothing a
pull would use. Every file is validated before the first upload: names and paths, no pickle
formats, and a well-formed header for every ``.safetensors`` file.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import structlog

from cache import manifest as mf
from cache.errors import IntegrityError
from cache.progress import Progress
from cache.retry import RetryPolicy, call_with_retries
from cache.safetensors_check import check_file
from cache.object_store import Store, blob_key, manifest_key


def publish_model(store: Store, directory: str | Path, name: str, progress: Progress | None = None,
                  retry: RetryPolicy | None = None, concurrency: int = 4,
                  also_as: tuple[str, ...] = (), reupload: bool = False) -> mf.Manifest:
    """Upload ``directory`` as model ``name``; returns the manifest written. Blocking.
    ``also_as``: more names for the same files, each a manifest of its own written after the
    first (the folder is read and hashed once: 16 GB took ~15 s a name). A blob the store holds
    at its size is skipped, unless ``reupload``: every blob is sent again, which replaces a store
    copy changed in place (its pulls fail their hash; a size check cannot tell)."""
    log = structlog.get_logger("publish").bind(model=name, store=store.url)
    retry = retry or RetryPolicy()
    progress = progress or Progress(name)
    progress.set_state("hashing")
    for n in also_as:
        mf.validate_name(n)  # before anything is written
    manifest, local = mf.from_directory(Path(directory), name)
    for f in manifest.files:
        if f.path.endswith(".safetensors"):
            check_file(local[f.path])
    progress.set_total(manifest.total_size)
    uploads: dict[str, tuple[Path, int]] = {}
    for f in manifest.files:
        uploads.setdefault(f.sha256, (local[f.path], f.size))
    log.info("publish.start", files=len(manifest.files), total_bytes=manifest.total_size)
    progress.set_state("uploading")

    def upload(item: tuple[str, tuple[Path, int]]) -> int:
        digest, (path, size) = item
        key = blob_key(digest)
        have = None if reupload else call_with_retries(lambda: store.exists(key), retry, f"HEAD {key}")
        if have is not None and have.size == size:
            progress.add_resumed(size)
            return 0
        # The file could have changed since it was hashed; a blob must hold what its name says.
        if path.stat().st_size != size:
            raise IntegrityError(f"{path} changed size while it was published")
        store.put_file(key, path, on_bytes=progress.add)
        return size

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        sent = sum(pool.map(upload, sorted(uploads.items(), key=lambda kv: -kv[1][1])))
    for n in (name, *also_as):
        data = dataclasses.replace(manifest, name=mf.validate_name(n)).to_json()
        call_with_retries(lambda: store.put_bytes(manifest_key(n), data), retry, f"manifest of {n}")
    progress.set_state("done")
    log.info("publish.done", uploaded_bytes=sent, skipped_bytes=manifest.total_size - sent)
    return manifest

"""Per-model snapshot folders: ``models/<name>/{manifest.json, snapshot/, .last_used}``.

A snapshot is a Hugging Face model folder whose files are hard links (symlinks where the
filesystem refuses hard links) into ``blobs/sha256``. It is built beside its final place and
renamed into it, so a reader sees either the old complete model or the new complete one.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
import uuid
from pathlib import Path

from cache.errors import CacheError, CacheFullError, ManifestError
from cache.fsync import fsync_dir
from cache import integrity
from cache import manifest as mf

LAST_USED = ".last_used"


def read_manifest(models_dir: Path, name: str) -> mf.Manifest | None:
    """The committed manifest of ``name``, or None when absent or unreadable."""
    try:
        return mf.parse((models_dir / name / "manifest.json").read_bytes(), expected_name=name)
    except (FileNotFoundError, NotADirectoryError, ManifestError):
        return None


def last_used(models_dir: Path, name: str) -> float:
    try:
        return (models_dir / name / LAST_USED).stat().st_mtime
    except FileNotFoundError:
        return 0.0


def touch(models_dir: Path, name: str) -> None:
    p = models_dir / name / LAST_USED
    try:
        os.utime(p)
    except FileNotFoundError:
        if (models_dir / name).is_dir():
            p.touch()


def _link(blob: Path, dest: Path) -> None:
    try:
        os.link(blob, dest)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        os.symlink(os.path.relpath(blob, dest.parent), dest)


def commit(models_dir: Path, blobs_dir: Path, manifest: mf.Manifest, fsync: bool = True) -> Path:
    """Build and atomically install the snapshot of ``manifest``; returns its snapshot folder.

    Every blob must already be verified in ``blobs_dir``; raises CacheError when one is missing.
    """
    name = manifest.name
    tmp = models_dir / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
    snap = tmp / "snapshot"
    try:
        snap.mkdir(parents=True)
        made: set[Path] = {snap}
        for f in manifest.files:
            blob = blobs_dir / f.sha256
            st = blob.stat() if blob.exists() else None
            if st is None or st.st_size != f.size:
                raise CacheError(f"{name}: blob of {f.path} is missing from the cache")
            dest = snap / f.path
            # validate_path already refused '..' and absolute paths; this guards the invariant.
            if not dest.resolve().is_relative_to(snap.resolve()):
                raise ManifestError(f"{name}: {f.path!r} escapes the snapshot folder")
            if dest.parent not in made:
                dest.parent.mkdir(parents=True, exist_ok=True)
                made.add(dest.parent)
            _link(blob, dest)
        (tmp / "manifest.json").write_bytes(manifest.to_json())
        integrity.record(tmp, manifest)  # every blob was verified on its way in
        (tmp / LAST_USED).touch()
        if fsync:
            for d in sorted(made, key=lambda p: len(p.parts), reverse=True):
                fsync_dir(d)
            with open(tmp / "manifest.json", "rb") as fh:
                os.fsync(fh.fileno())
            fsync_dir(tmp)
        final = models_dir / name
        trash = None
        if final.exists():
            trash = models_dir / f".trash-{name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, trash)
        os.rename(tmp, final)
        if fsync:
            fsync_dir(models_dir)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        return final / "snapshot"
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise CacheFullError(f"{name}: no space left to build the snapshot") from None
        raise CacheError(f"{name}: could not build the snapshot: {e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove(models_dir: Path, name: str) -> None:
    """Remove a model's folder: renamed away first so no reader sees half of it."""
    final = models_dir / name
    if not final.exists():
        return
    trash = models_dir / f".trash-{name}-{uuid.uuid4().hex[:8]}"
    os.rename(final, trash)
    shutil.rmtree(trash, ignore_errors=True)


def clean_leftovers(models_dir: Path, older_than_s: float = 3600.0) -> None:
    """Remove ``.tmp-``/``.trash-`` folders left by a process that died mid-commit."""
    now = time.time()
    for p in models_dir.glob(".t*-*"):
        if p.name.startswith((".tmp-", ".trash-")):
            try:
                if now - p.stat().st_mtime > older_than_s:
                    shutil.rmtree(p, ignore_errors=True)
            except FileNotFoundError:
                pass

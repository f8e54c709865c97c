"""Triton's installation hash, kept across restarts.

Before its first kernel-cache lookup, every process that uses Triton computes ``triton_key()``: a
sha256 of Triton's ~500 MB library and of its compiler sources. On a restart that was the runner's
build waiting (py-spy of a restart's load on the H200: 327 of the build's 827 samples; 1.0 s on a
2-core box). The hash depends only on the installed files, so the worker keeps the value Triton
computed in ``<cache>/engine/triton-key.json``, stamped with the name, size, mtime and inode of
every file under Triton's package, and a later process whose stamp matches gives Triton that value
(the way Triton's own compile-warmup workers receive theirs: ``triton.runtime.cache.triton_key``
replaced by a function returning it). Any change to the installation changes the stamp, and the
key is computed again (by Triton) and the file rewritten. A missing, oversized or damaged file is
treated as no file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MAX_FILE_BYTES = 64 << 10


def installation_stamp(root: str | os.PathLike) -> str:
    """A digest of every file under ``root`` by relative path, size, mtime and inode."""
    h = hashlib.sha256()
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for f in sorted(files):
            p = os.path.join(d, f)
            try:
                st = os.stat(p)
            except OSError:
                continue
            h.update(f"{os.path.relpath(p, root)}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\n".encode())
    return h.hexdigest()


def _read(path: Path) -> dict | None:
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and isinstance(data.get("stamp"), str) and isinstance(data.get("key"), str)
    return data if ok else None


def _write(path: Path, stamp: str, key: str) -> None:
    body = json.dumps({"stamp": stamp, "key": key}).encode()
    if len(body) > MAX_FILE_BYTES:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_bytes(body)
        os.replace(tmp, path)
    except OSError:  # read-only, full: the next start computes it once more
        pass


def prime_triton(path: Path | None) -> str:
    """Make this process's ``triton_key()`` ready before its first kernel lookup: from ``path``
    when its stamp matches the installation ("kept"), else computed by Triton and written there
    ("computed"); "none" without Triton (or without the function in this version)."""
    try:
        import triton
        from triton.runtime import cache
    except ImportError:
        return "none"
    real = getattr(cache, "triton_key", None)
    if real is None:
        return "none"
    if path is None:
        real()
        return "computed"
    stamp = installation_stamp(os.path.dirname(os.path.abspath(triton.__file__)))
    kept = _read(path)
    if kept is not None and kept["stamp"] == stamp:
        key = kept["key"]
        cache.triton_key = lambda: key
        return "kept"
    _write(path, stamp, real())
    return "computed"

"""Derived artifacts: what is computed from a cached model's files once and kept beside them.

Today one scheme: ``fp8-channel`` — the FP8 checkpoint of a bf16 model (e4m3 weights, one scale per
output channel, dynamic per-token activations: exactly what the engine computes when it quantizes
at load), so that later FP8 loads read half the bytes and quantize nothing.

Layout under the cache directory::

    derived/<scheme>/<source digest>/        a model folder the engine loads as it is
    derived/<scheme>/<source digest>/DERIVED.json   written last: version, scheme, source,
                                             files [{path, size, sha256}]
    derived/<scheme>/.<digest>.partial-<pid>/  a build in progress (swept when its owner is gone)

``source digest`` identifies the files it was computed from (:func:`content_digest`: paths, sizes
and sha256 of a manifest, not its name): two names publishing the same files share one artifact,
and a new version of a model never reads the old one's. An artifact is trusted only whole: its record is
written after every file, checked strictly (format version, scheme, source, names, sizes, digests
shaped as the manifest's), and every file's size is checked at each lookup; ``verify`` re-reads
every sha256, as for blobs. Anything that fails a check is removed, never served.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from cache import manifest as mf
from cache.errors import ManifestError

FORMAT_VERSION = 1
SCHEMES = ("fp8-channel",)
RECORD = "DERIVED.json"
MAX_RECORD_BYTES = 1 << 20
MAX_FILES = 4096


class DerivedError(Exception):
    """A derived artifact that is not what its record says (it is removed)."""


@dataclass(frozen=True)
class DerivedFile:
    path: str
    size: int
    sha256: str


def content_digest(manifest: mf.Manifest) -> str:
    """What an artifact is computed from: the files of a model version (paths, sizes, digests),
    not its name, so every name published from one folder shares one artifact."""
    files = sorted((f.path, f.size, f.sha256) for f in manifest.files)
    return hashlib.sha256(json.dumps(files, separators=(",", ":")).encode()).hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class DerivedStore:
    """The derived artifacts of one cache directory (thread-safe by construction: every change is
    a rename of a whole folder)."""

    def __init__(self, cache_dir: str | os.PathLike[str]) -> None:
        self.root = Path(cache_dir) / "derived"

    def _dir(self, scheme: str, source: str) -> Path:
        if scheme not in SCHEMES:
            raise DerivedError(f"unknown derived scheme {scheme!r}; known: {', '.join(SCHEMES)}")
        if not mf.DIGEST_RE.fullmatch(source):
            raise DerivedError(f"{source!r} is not a manifest digest")
        return self.root / scheme / source

    def lookup(self, scheme: str, source: str) -> Path | None:
        """The artifact's folder when it is whole (record valid, every file of its size), else
        None; a damaged one is removed."""
        d = self._dir(scheme, source)
        if not (d / RECORD).is_file():
            return None
        try:
            files = self._record(d, scheme, source)
            for f in files:
                p = d / f.path
                if not p.is_file() or p.stat().st_size != f.size:
                    raise DerivedError(f"{f.path}: missing or not {f.size} bytes")
        except (DerivedError, OSError) as e:
            self.remove(scheme, source, why=str(e))
            return None
        return d

    def verify(self, scheme: str, source: str) -> list[str]:
        """Every file's sha256 against the record (empty: whole); a damaged artifact is removed."""
        d = self.lookup(scheme, source)
        if d is None:
            return ["not present"]
        problems = [f"{f.path}: sha256 mismatch" for f in self._record(d, scheme, source)
                    if _sha256(d / f.path) != f.sha256]
        if problems:
            self.remove(scheme, source, why=problems[0])
        return problems

    def building(self, scheme: str, source: str) -> Path:
        """A fresh folder to build ``scheme`` of ``source`` in (handed to :meth:`commit`)."""
        final = self._dir(scheme, source)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{source}.partial-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        return tmp

    def commit(self, scheme: str, source: str, built: Path) -> Path:
        """Record every file of ``built`` (size, sha256), write the record last, then move the
        folder into place in one rename; returns the artifact's folder. An artifact already
        there (built by another process meanwhile) is kept and ``built`` removed."""
        final = self._dir(scheme, source)
        files = sorted(p for p in built.rglob("*") if p.is_file())
        if not files or len(files) > MAX_FILES:
            raise DerivedError(f"a derived artifact holds 1..{MAX_FILES} files, not {len(files)}")
        record = {"version": FORMAT_VERSION, "scheme": scheme, "source": source,
                  "files": [{"path": p.relative_to(built).as_posix(), "size": p.stat().st_size,
                             "sha256": _sha256(p)} for p in files]}
        (built / RECORD).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        try:
            built.rename(final)
        except OSError:
            if self.lookup(scheme, source) is None:
                raise
            shutil.rmtree(built, ignore_errors=True)
        return final

    def remove(self, scheme: str, source: str, why: str = "") -> None:
        """Take an artifact out: renamed away first (a reader never sees half of it), then deleted."""
        d = self._dir(scheme, source)
        if d.exists():
            gone = d.parent / f".{source}.removed-{os.getpid()}"
            shutil.rmtree(gone, ignore_errors=True)
            d.rename(gone)
            shutil.rmtree(gone, ignore_errors=True)

    def sweep(self, live_sources: set[str]) -> int:
        """Remove artifacts whose source no cached model has any longer, and builds whose
        process is gone; returns the bytes freed."""
        freed = 0
        for scheme in SCHEMES:
            base = self.root / scheme
            if not base.is_dir():
                continue
            for d in base.iterdir():
                dead_build = ".partial-" in d.name and not _alive(d.name.rsplit("-", 1)[-1])
                stale = not d.name.startswith(".") and d.name not in live_sources
                if dead_build or stale or ".removed-" in d.name:
                    freed += sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
                    shutil.rmtree(d, ignore_errors=True)
        return freed

    def sizes_by_source(self) -> dict[str, int]:
        """Bytes of the artifacts of each source digest, every scheme together."""
        out: dict[str, int] = {}
        for scheme in SCHEMES:
            base = self.root / scheme
            if base.is_dir():
                for d in base.iterdir():
                    if not d.name.startswith("."):
                        out[d.name] = out.get(d.name, 0) + sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
        return out

    def used_bytes(self) -> int:
        if not self.root.is_dir():
            return 0
        return sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file())

    def _record(self, d: Path, scheme: str, source: str) -> list[DerivedFile]:
        raw = (d / RECORD).read_bytes()
        if len(raw) > MAX_RECORD_BYTES:
            raise DerivedError("record too large")
        try:
            rec = json.loads(raw)
        except ValueError as e:
            raise DerivedError(f"record is not JSON: {e}") from None
        if not isinstance(rec, dict) or rec.get("version") != FORMAT_VERSION or rec.get("scheme") != scheme \
                or rec.get("source") != source or not isinstance(rec.get("files"), list) \
                or not 0 < len(rec["files"]) <= MAX_FILES:
            raise DerivedError("record does not describe this artifact")
        out = []
        for f in rec["files"]:
            if not isinstance(f, dict) or set(f) != {"path", "size", "sha256"}:
                raise DerivedError("bad file entry")
            path, size, digest = f["path"], f["size"], f["sha256"]
            if not isinstance(path, str) or not isinstance(size, int) or isinstance(size, bool) or size < 0 \
                    or not isinstance(digest, str) or not mf.DIGEST_RE.fullmatch(digest):
                raise DerivedError("bad file entry")
            try:
                mf.validate_path(path)
            except ManifestError as e:
                raise DerivedError(str(e)) from None
            out.append(DerivedFile(path, size, digest))
        return out


def _alive(pid: str) -> bool:
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

"""Snapshot integrity: does a cached model still hold the bytes its manifest names?

Sizes are always checked (one ``stat`` per file). A file's sha256 is read again when asked
(``rehash``: a verified pull, the ``verify`` action, a pull after a failed load) or when the file
changed since it was last verified: committing a snapshot, and every check that hashed it clean,
records each snapshot file's (size, mtime, inode) in ``models/<name>/verified.json``; a file found
with another stamp (rewritten in place, or replaced by a new file) is hashed before it is trusted.
Blocking: run in a thread.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from cache import manifest as mf

VERIFIED = "verified.json"


@dataclass(frozen=True)
class Finding:
    path: str  # the file, as the manifest names it
    problem: str
    bad_blob: str | None = None  # a blob whose bytes are wrong: a repair drops it


@dataclass
class Report:
    name: str
    findings: list[Finding] = field(default_factory=list)
    hashed: int = 0  # files whose sha256 was read

    @property
    def ok(self) -> bool:
        return not self.findings

    def problems(self) -> list[str]:
        return [f"{f.path}: {f.problem}" for f in self.findings]

    def summary(self) -> str:
        more = f" (and {len(self.findings) - 3} more)" if len(self.findings) > 3 else ""
        return "; ".join(self.problems()[:3]) + more


def _stamp(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _read_record(model_dir: Path) -> dict[str, list[int]]:
    try:
        doc = json.loads((model_dir / VERIFIED).read_bytes())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def record(model_dir: Path, manifest: mf.Manifest) -> None:
    """Record the stamps of the snapshot's files as verified now (written atomically)."""
    snap = model_dir / "snapshot"
    stamps = {f.path: _stamp((snap / f.path).stat()) for f in manifest.files}
    tmp = model_dir / f".{VERIFIED}.{uuid.uuid4().hex[:8]}"
    tmp.write_text(json.dumps(stamps, sort_keys=True))
    os.replace(tmp, model_dir / VERIFIED)


def forget(model_dir: Path) -> None:
    """Drop the record: the next check hashes every file of the snapshot."""
    (model_dir / VERIFIED).unlink(missing_ok=True)


def check(model_dir: Path, manifest: mf.Manifest, *, rehash: bool = False,
          blobs_dir: Path | None = None) -> Report:
    """Check the snapshot of ``manifest`` under ``model_dir``.

    With ``blobs_dir`` (a pull or a verify) each snapshot file must also still be its blob: a
    blob deleted behind the cache's back is found, and a repair fetches it again. Without it (a
    load) only what the engine reads counts. Records the stamps when it hashed files and found
    nothing wrong.
    """
    snap = model_dir / "snapshot"
    seen = _read_record(model_dir)
    report = Report(manifest.name)
    hashed_ok = False
    for f in manifest.files:
        p = snap / f.path
        try:
            st = p.stat()
        except (FileNotFoundError, NotADirectoryError):
            report.findings.append(Finding(f.path, "missing from the snapshot"))
            continue
        blob = blobs_dir / f.sha256 if blobs_dir is not None else None
        try:
            bst = blob.stat() if blob is not None else None
        except FileNotFoundError:
            report.findings.append(Finding(f.path, "its blob is missing from the cache"))
            continue
        is_blob = bst is not None and (bst.st_dev, bst.st_ino) == (st.st_dev, st.st_ino)
        if st.st_size != f.size:
            report.findings.append(Finding(f.path, f"is {st.st_size} bytes, the manifest says {f.size}",
                                           f.sha256 if is_blob else None))
            continue
        if bst is not None and not is_blob:
            report.findings.append(Finding(f.path, "the snapshot entry is not its blob"))
            continue
        if rehash or seen.get(f.path) != _stamp(st):
            report.hashed += 1
            if mf.hash_file(p)[1] != f.sha256:
                report.findings.append(Finding(f.path, "its sha256 does not match the manifest",
                                               f.sha256 if is_blob else None))
                continue
            hashed_ok = True
    if report.ok and hashed_ok:
        record(model_dir, manifest)
    return report

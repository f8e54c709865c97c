"""Model manifests: ``<prefix>/models/<name>/manifest.json`` in the store and the cache.

A manifest lists every file of a model folder with its size and sha256; the blobs live under
``blobs/sha256/<hex>``. Validation is strict and happens before any byte of the model is written:
names, paths, digests, sizes, duplicates and pickle formats are checked here.

Format (``version`` 1)::

    {"version": 1, "name": "llama-3.1-8b", "total_size": 123,
     "files": [{"path": "config.json", "size": 123, "sha256": "<64 hex>"}]}
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cache.errors import ManifestError
from cache.strict_json import no_duplicate_keys

MANIFEST_VERSION = 1
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
# Formats that execute code when loaded; the engine reads safetensors only.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
MAX_FILES = 10_000
MAX_FILE_SIZE = 1 << 40  # 1 TiB: no single weight shard is larger
MAX_TOTAL_SIZE = 4 << 40  # 4 TiB: beyond any model one GPU serves
MAX_PATH_LEN = 1024
MAX_COMPONENT_LEN = 255
MAX_MANIFEST_BYTES = 8 << 20


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    name: str
    files: tuple[FileEntry, ...]
    version: int = MANIFEST_VERSION

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def to_dict(self) -> dict:
        return {
            "version": self.version,
            "name": self.name,
            "total_size": self.total_size,
            "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in self.files],
        }

    def to_json(self) -> bytes:
        return (json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n").encode()

    def digest(self) -> str:
        """sha256 of the canonical JSON: identifies a model version."""
        return hashlib.sha256(self.to_json()).hexdigest()

    def unique_blobs(self) -> dict[str, int]:
        """digest → size, each blob once (two paths may share content)."""
        return {f.sha256: f.size for f in self.files}


def validate_name(name: object) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ManifestError(f"{name!r} is not a model name (^[a-z0-9][a-z0-9._-]{{0,127}}$)")
    return name


def validate_digest(digest: object, where: str = "sha256") -> str:
    if not isinstance(digest, str) or not DIGEST_RE.fullmatch(digest):
        raise ManifestError(f"{where}: {digest!r} is not 64 lowercase hex digits")
    return digest


def validate_path(path: object) -> str:
    """A relative POSIX path inside the model folder; refuses anything that could escape it."""
    if not isinstance(path, str) or not path:
        raise ManifestError(f"file path {path!r} must be a non-empty string")
    if len(path) > MAX_PATH_LEN:
        raise ManifestError(f"file path {path[:64]!r}... is longer than {MAX_PATH_LEN} characters")
    if "\x00" in path:
        raise ManifestError(f"file path {path!r} contains NUL")
    if "\\" in path:
        raise ManifestError(f"file path {path!r} contains a backslash")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        raise ManifestError(f"file path {path!r} contains a control character")
    if path.startswith("/"):
        raise ManifestError(f"file path {path!r} is absolute")
    for part in path.split("/"):
        if part in ("", ".", ".."):
            raise ManifestError(f"file path {path!r} has an empty, '.' or '..' component")
        if len(part.encode()) > MAX_COMPONENT_LEN:
            raise ManifestError(f"file path {path!r} has a component longer than {MAX_COMPONENT_LEN} bytes")
    if path.lower().endswith(PICKLE_SUFFIXES):
        raise ManifestError(f"file {path!r} is a pickle format; only safetensors weights are accepted")
    return path


def _validate_size(size: object, path: str) -> int:
    if isinstance(size, bool) or not isinstance(size, int):
        raise ManifestError(f"{path}: size {size!r} is not an integer")
    if size < 0 or size > MAX_FILE_SIZE:
        raise ManifestError(f"{path}: size {size} is outside [0, {MAX_FILE_SIZE}]")
    return size


def build(name: str, files: list[FileEntry]) -> Manifest:
    """Validate and assemble a manifest; raises ManifestError naming the first defect."""
    validate_name(name)
    if not files:
        raise ManifestError(f"model {name!r} has no files")
    if len(files) > MAX_FILES:
        raise ManifestError(f"model {name!r} has {len(files)} files (at most {MAX_FILES})")
    seen: set[str] = set()
    folded: set[str] = set()
    for f in files:
        validate_path(f.path)
        _validate_size(f.size, f.path)
        validate_digest(f.sha256, f"{f.path}: sha256")
        if f.path in seen:
            raise ManifestError(f"file path {f.path!r} is listed twice")
        # Case-insensitive filesystems would merge these; refuse rather than overwrite.
        if f.path.lower() in folded:
            raise ManifestError(f"file path {f.path!r} differs from another only by case")
        seen.add(f.path)
        folded.add(f.path.lower())
    for p in seen:  # "a" as a file and "a/b" would need "a" to be both
        parts = p.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in seen:
                raise ManifestError(f"file path {p!r} lies under another file {'/'.join(parts[:i])!r}")
    total = sum(f.size for f in files)
    if total > MAX_TOTAL_SIZE:
        raise ManifestError(f"model {name!r} totals {total} bytes (at most {MAX_TOTAL_SIZE})")
    return Manifest(name=name, files=tuple(sorted(files, key=lambda f: f.path)))


def parse(data: bytes, expected_name: str | None = None) -> Manifest:
    """Parse and validate manifest JSON; raises ManifestError."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest is {len(data)} bytes (at most {MAX_MANIFEST_BYTES})")
    try:
        doc = json.loads(data.decode("utf-8"), object_pairs_hook=no_duplicate_keys("manifest", ManifestError))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"manifest is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ManifestError("manifest is not a JSON object")
    unknown = set(doc) - {"version", "name", "files", "total_size"}
    if unknown:
        raise ManifestError(f"manifest has unknown keys {sorted(unknown)}")
    if doc.get("version") != MANIFEST_VERSION:
        raise ManifestError(f"manifest version {doc.get('version')!r} is not supported (want {MANIFEST_VERSION})")
    name = validate_name(doc.get("name"))
    if expected_name is not None and name != expected_name:
        raise ManifestError(f"manifest names model {name!r}, expected {expected_name!r}")
    raw_files = doc.get("files")
    if not isinstance(raw_files, list):
        raise ManifestError("manifest 'files' is not a list")
    if len(raw_files) > MAX_FILES:
        raise ManifestError(f"manifest lists {len(raw_files)} files (at most {MAX_FILES})")
    files = []
    for i, item in enumerate(raw_files):
        if not isinstance(item, dict) or set(item) != {"path", "size", "sha256"}:
            raise ManifestError(f"manifest file #{i} must be an object with exactly path, size, sha256")
        path = validate_path(item["path"])
        files.append(FileEntry(path=path, size=_validate_size(item["size"], path),
                               sha256=validate_digest(item["sha256"], f"{path}: sha256")))
    manifest = build(name, files)
    if "total_size" in doc and doc["total_size"] != manifest.total_size:
        raise ManifestError(f"manifest total_size {doc['total_size']!r} is not the sum of its file sizes "
                            f"({manifest.total_size})")
    return manifest


def hash_file(path: Path, chunk: int = 8 << 20) -> tuple[int, str]:
    """(size, sha256 hex) of a file, read in large chunks (hashlib drops the GIL on them)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def from_directory(root: Path, name: str) -> tuple[Manifest, dict[str, Path]]:
    """Manifest of a model folder (hidden files skipped) and the map path → local file.

    Refuses symlinks that leave the folder and anything that is not a regular file.
    """
    root = Path(root)
    if not root.is_dir():
        raise ManifestError(f"{root} is not a directory")
    validate_name(name)
    real_root = root.resolve()
    entries: list[FileEntry] = []
    local: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for fn in sorted(filenames):
            if fn.startswith("."):
                continue
            p = Path(dirpath) / fn
            rel = p.relative_to(root).as_posix()
            validate_path(rel)  # pickle files and odd names are refused before hashing anything
            real = p.resolve()
            if not real.is_relative_to(real_root) and p.is_symlink():
                raise ManifestError(f"{rel}: symlink points outside {root}")
            if not real.is_file():
                raise ManifestError(f"{rel}: not a regular file")
            local[rel] = real
    for rel, real in local.items():
        size, digest = hash_file(real)
        entries.append(FileEntry(rel, size, digest))
    return build(name, entries), local

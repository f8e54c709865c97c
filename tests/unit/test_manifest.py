"""Manifest validation: every malformed name, path, digest, size or format is refused."""

from __future__ import annotations

import asyncio
import hashlib
import json

import pytest

from cache.disk_cache import DiskCache

from cache.errors import ManifestError

from cache.file_store import FileStore
from cache import manifest as mf

D = "a" * 64


def doc(**over) -> dict:
    d = {"version": 1, "name": "llama-3.1-8b", "total_size": 10,
         "files": [{"path": "config.json", "size": 10, "sha256": D}]}
    d.update(over)
    return d


def raw(d: dict) -> bytes:
    return json.dumps(d).encode()


def one_file(**over) -> dict:
    f = {"path": "config.json", "size": 10, "sha256": D}
    f.update(over)
    return doc(files=[f], total_size=f["size"] if isinstance(f["size"], int) and not isinstance(f["size"], bool) else 0)


def test_round_trip_and_digest():
    m = mf.parse(raw(doc()))
    assert m.name == "llama-3.1-8b" and m.files[0] == mf.FileEntry("config.json", 10, D)
    assert mf.parse(m.to_json()) == m and m.total_size == 10
    assert m.digest() == hashlib.sha256(m.to_json()).hexdigest()


@pytest.mark.parametrize("name", ["", "Llama", "-x", ".x", "a/b", "a b", "x" * 129, "ü", None, 7, "a\x00"])
def test_bad_names(name):
    with pytest.raises(ManifestError, match="model name"):
        mf.parse(raw(doc(name=name)))


@pytest.mark.parametrize("path,why", [
    ("../etc/passwd", "'..'"), ("a/../../b", "'..'"), ("/etc/passwd", "absolute"), ("a\x00b", "NUL"),
    ("a\\b", "backslash"), ("", "non-empty"), ("a//b", "empty"), ("./a", "'.'"), ("a/", "empty"),
    ("a\nb", "control"), ("x" * 300, "component"), ("a/" * 600 + "b", "longer"),
])
def test_bad_paths(path, why):
    with pytest.raises(ManifestError, match=why):
        mf.parse(raw(one_file(path=path)))


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".BIN"])
def test_pickle_formats_refused(suffix):
    with pytest.raises(ManifestError, match="pickle"):
        mf.parse(raw(one_file(path=f"pytorch_model{suffix}")))


@pytest.mark.parametrize("digest", ["A" * 64, "a" * 63, "a" * 65, "g" * 64, "", None, 12, " " + "a" * 63])
def test_bad_digests(digest):
    with pytest.raises(ManifestError, match="64 lowercase hex"):
        mf.parse(raw(one_file(sha256=digest)))


@pytest.mark.parametrize("size", [-1, 1.5, "10", True, None, mf.MAX_FILE_SIZE + 1])
def test_bad_sizes(size):
    with pytest.raises(ManifestError, match="size"):
        mf.parse(raw(one_file(size=size)))


def test_total_size_bounded():
    files = [{"path": f"f{i}", "size": mf.MAX_FILE_SIZE, "sha256": D} for i in range(5)]
    with pytest.raises(ManifestError, match="totals"):
        mf.parse(raw(doc(files=files, total_size=5 * mf.MAX_FILE_SIZE)))


@pytest.mark.parametrize("mutate,why", [
    (lambda d: d.update(version=2), "version"),
    (lambda d: d.pop("version"), "version"),
    (lambda d: d.update(extra=1), "unknown keys"),
    (lambda d: d.update(files={}), "not a list"),
    (lambda d: d.update(files=[]), "no files"),
    (lambda d: d.update(total_size=11), "total_size"),
    (lambda d: d["files"].append(dict(d["files"][0])), "twice"),
    (lambda d: d["files"].append({"path": "CONFIG.json", "size": 1, "sha256": D}), "case"),
    (lambda d: d["files"].append({"path": "config.json/x", "size": 1, "sha256": D}), "under another file"),
    (lambda d: d["files"][0].update(mode="x"), "exactly path, size, sha256"),
    (lambda d: d["files"].__setitem__(0, "config.json"), "exactly path, size, sha256"),
])
def test_bad_structure(mutate, why):
    d = doc()
    mutate(d)
    with pytest.raises(ManifestError, match=why):
        mf.parse(raw(d))


def test_expected_name_mismatch_and_non_json():
    with pytest.raises(ManifestError, match="expected 'other'"):
        mf.parse(raw(doc()), expected_name="other")
    for bad in (b"\xff\xfe", b"[1]", b"{", b'{"version": 1, "version": 1}'):
        with pytest.raises(ManifestError):
            mf.parse(bad)
    with pytest.raises(ManifestError, match="bytes"):
        mf.parse(b" " * (mf.MAX_MANIFEST_BYTES + 1))


def test_too_many_files():
    files = [{"path": f"f{i}", "size": 1, "sha256": D} for i in range(mf.MAX_FILES + 1)]
    with pytest.raises(ManifestError, match="files"):
        mf.parse(raw(doc(files=files, total_size=len(files))))


@pytest.mark.parametrize("bad", [
    one_file(path="../../escape"), one_file(path="/abs"), one_file(sha256="F" * 64), one_file(path="w.pt"),
])
def test_bad_manifest_in_store_writes_nothing(tmp_path, bad):
    """A pull refuses the manifest before any blob is fetched or any file is written."""
    store = FileStore(tmp_path / "store")
    store.put_bytes("models/llama-3.1-8b/manifest.json", raw(bad))
    store.put_bytes(f"blobs/sha256/{D}", b"0123456789")
    cache = DiskCache(tmp_path / "cache", 1 << 30)
    with pytest.raises(ManifestError):
        asyncio.run(cache.pull(store, "llama-3.1-8b"))
    written = [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and "locks" not in p.parts]
    assert written == [] and not (tmp_path / "escape").exists()


def test_from_directory_refuses_pickles_and_escaping_links(tmp_path):
    src = tmp_path / "m"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / ".hidden").write_text("skipped")
    m, local = mf.from_directory(src, "m")
    assert [f.path for f in m.files] == ["config.json"]
    (tmp_path / "secret").write_text("x")
    (src / "link.json").symlink_to(tmp_path / "secret")
    with pytest.raises(ManifestError, match="outside"):
        mf.from_directory(src, "m")
    (src / "link.json").unlink()
    (src / "model.pth").write_bytes(b"x")
    with pytest.raises(ManifestError, match="pickle"):
        mf.from_directory(src, "m")

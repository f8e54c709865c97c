"""The safetensors header check refuses every defect before anything reads tensors."""

from __future__ import annotations

import asyncio
import json
import struct

import numpy as np
import pytest
from safetensors.numpy import save_file

from cache.disk_cache import DiskCache

from cache.errors import SafetensorsError

from cache.file_store import FileStore
from cache import manifest as mf
from cache.publish import publish_model
from cache.safetensors_check import MAX_HEADER_BYTES, check_file


def write(path, header, data: bytes = b"", length: int | None = None, raw: bytes | None = None):
    body = raw if raw is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body) if length is None else length) + body + data)
    return path


def t(dtype="F32", shape=(2,), offsets=(0, 8)) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def test_files_written_by_the_library_pass(tmp_path):
    p = tmp_path / "ok.safetensors"
    save_file({"a": np.zeros((3, 4), np.float16), "b": np.ones(5, np.int64), "empty": np.zeros((0, 7), np.float32),
               "u": np.zeros(3, np.uint8)}, str(p), metadata={"format": "pt"})
    h = check_file(p)
    assert {x.name for x in h.tensors} == {"a", "b", "empty", "u"} and h.metadata == {"format": "pt"}
    assert write(tmp_path / "none.safetensors", {}).exists() and check_file(tmp_path / "none.safetensors").tensors == ()


@pytest.mark.parametrize("case,why", [
    ("short", "too short"),
    ("len_small", "outside"),
    ("len_huge", "outside"),
    ("len_past_end", "past the end of the file"),
    ("not_utf8", "not UTF-8"),
    ("not_json", "not JSON"),
    ("array", "not a JSON object"),
    ("dup_key", "repeats the key"),
    ("metadata", "__metadata__"),
    ("missing_field", "exactly dtype, shape, data_offsets"),
    ("extra_field", "exactly dtype, shape, data_offsets"),
    ("dtype", "unknown dtype"),
    ("shape_negative", "non-negative ints"),
    ("shape_float", "non-negative ints"),
    ("shape_bool", "non-negative ints"),
    ("shape_not_list", "non-negative ints"),
    ("shape_overflow", "overflows"),
    ("offsets_three", r"not \[begin, end\]"),
    ("offsets_reversed", "reversed"),
    ("offsets_negative", "reversed or negative"),
    ("size_mismatch", "needs"),
    ("past_end", "past the end of the file"),
    ("overlap", "overlaps"),
    ("hole", "hole of 4 bytes"),
    ("hole_at_start", "hole of 8 bytes"),
    ("trailing", "trailing bytes"),
])
def test_defects(tmp_path, case, why):
    p = tmp_path / "bad.safetensors"
    ok = {"a": t()}
    d8 = b"\0" * 8
    if case == "short":
        p.write_bytes(b"\1\0\0")
    elif case == "len_small":
        write(p, None, raw=b"{", length=1)
    elif case == "len_huge":
        write(p, None, raw=b"{}", length=MAX_HEADER_BYTES + 1)
    elif case == "len_past_end":
        write(p, None, raw=b"{}", length=500)
    elif case == "not_utf8":
        write(p, None, raw=b'{"\xff": 1}')
    elif case == "not_json":
        write(p, None, raw=b"{not json}")
    elif case == "array":
        write(p, None, raw=b"[1, 2]")
    elif case == "dup_key":
        write(p, None, raw=b'{"a": %s, "a": %s}' % (json.dumps(t()).encode(), json.dumps(t()).encode()), data=d8)
    elif case == "metadata":
        write(p, {"__metadata__": {"k": 1}, **ok}, d8)
    elif case == "missing_field":
        write(p, {"a": {"dtype": "F32", "shape": [2]}}, d8)
    elif case == "extra_field":
        write(p, {"a": {**t(), "x": 1}}, d8)
    elif case == "dtype":
        write(p, {"a": t(dtype="F128")}, d8)
    elif case == "shape_negative":
        write(p, {"a": t(shape=(-2,))}, d8)
    elif case == "shape_float":
        write(p, {"a": t(shape=(2.0,))}, d8)
    elif case == "shape_bool":
        write(p, {"a": t(shape=(True, 2))}, d8)
    elif case == "shape_not_list":
        write(p, {"a": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}}, d8)
    elif case == "shape_overflow":
        write(p, {"a": t(shape=(1 << 32, 1 << 32, 1 << 32))}, d8)
    elif case == "offsets_three":
        write(p, {"a": t(offsets=(0, 4, 8))}, d8)
    elif case == "offsets_reversed":
        write(p, {"a": t(offsets=(8, 0))}, d8)
    elif case == "offsets_negative":
        write(p, {"a": t(offsets=(-8, 0))}, d8)
    elif case == "size_mismatch":
        write(p, {"a": t(shape=(3,))}, d8)
    elif case == "past_end":
        write(p, {"a": t()}, b"\0" * 4)
    elif case == "overlap":
        write(p, {"a": t(offsets=(0, 8)), "b": t(offsets=(4, 12))}, b"\0" * 12)
    elif case == "hole":
        write(p, {"a": t(offsets=(0, 8)), "b": t(offsets=(12, 20))}, b"\0" * 20)
    elif case == "hole_at_start":
        write(p, {"a": t(offsets=(8, 16))}, b"\0" * 16)
    elif case == "trailing":
        write(p, ok, d8 + b"junk")
    with pytest.raises(SafetensorsError, match=why):
        check_file(p)


def _bad_model(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    write(src / "model.safetensors", {"a": t()}, b"\0" * 8 + b"trailing")
    return src


def test_publish_refuses_a_bad_header_before_uploading(tmp_path):
    store = FileStore(tmp_path / "store")
    with pytest.raises(SafetensorsError, match="trailing"):
        publish_model(store, _bad_model(tmp_path), "m")
    assert not (tmp_path / "store").exists()


def test_pull_refuses_a_bad_header_and_commits_nothing(tmp_path):
    """A store holding a bad file (published by another tool): the cache keeps nothing of it."""
    src = _bad_model(tmp_path)
    store = FileStore(tmp_path / "store")
    entries = []
    for name in ("config.json", "model.safetensors"):
        size, digest = mf.hash_file(src / name)
        store.put_file(f"blobs/sha256/{digest}", src / name)
        entries.append(mf.FileEntry(name, size, digest))
    store.put_bytes("models/m/manifest.json", mf.build("m", entries).to_json())
    cache = DiskCache(tmp_path / "cache", 1 << 30)
    with pytest.raises(SafetensorsError, match="trailing"):
        asyncio.run(cache.pull(store, "m"))
    bad = next(e for e in entries if e.path == "model.safetensors")
    assert not (tmp_path / "cache/blobs/sha256" / bad.sha256).exists()
    assert not list((tmp_path / "cache/partial").iterdir()) and cache.snapshot_path("m") is None

"""The Triton cache sweep before a worker's first load (cache/triton_cache.py), on entries written
by Triton's own cache manager: damaged kernels go (Triton compiles them again), so do dead
writers' temporaries; sound kernels, foreign ones and records it does not understand stay."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cache.triton_cache import sweep_triton_cache

triton_cache = pytest.importorskip("triton.runtime.cache")


def _kernel(key: str, name: str = "k") -> dict[str, str]:
    """One kernel's files as Triton writes them: metadata JSON, a binary, and the group record."""
    m = triton_cache.FileCacheManager(key)
    paths = {f"{name}.json": m.put(json.dumps({"name": name, "num_warps": 4}), f"{name}.json", binary=False),
             f"{name}.cubin": m.put(b"\x7fELF" + b"\x00" * 64, f"{name}.cubin")}
    m.put_group(f"{name}.json", paths)
    return paths


def test_damaged_kernels_and_dead_writers_go_the_rest_stays(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    good = _kernel("a" * 32)
    foreign = _kernel("b" * 32)  # another GPU's or version's key: never looked up, harmless
    bad_meta = _kernel("c" * 32)
    empty_bin = _kernel("d" * 32)
    missing = _kernel("e" * 32)
    open(bad_meta["k.json"], "w").write('{"name": "k", "num_wa')  # cut short
    open(empty_bin["k.cubin"], "wb").close()
    (tmp_path / ("e" * 32) / "k.cubin").unlink()  # Triton misses on this itself: left alone
    (tmp_path / ("f" * 32)).mkdir()
    (tmp_path / ("f" * 32) / "__grp__k.json").write_text("not json")  # Triton misses: left alone
    (tmp_path / ("f" * 32) / "launcher.so").write_bytes(b"so")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / ("a" * 32) / f"tmp.pid_{dead.pid}_1234").mkdir()
    alive = tmp_path / ("a" * 32) / f"tmp.pid_{os.getpid()}_5678"
    alive.mkdir()

    removed = sweep_triton_cache(tmp_path)
    assert sorted(r.split(":")[0].rsplit("/", 1)[1] for r in removed) == sorted(
        ["c" * 32, "d" * 32, f"tmp.pid_{dead.pid}_1234"]), removed
    assert any("does not parse" in r for r in removed) and any("is empty" in r for r in removed)
    assert not (tmp_path / ("c" * 32)).exists() and not (tmp_path / ("d" * 32)).exists()
    assert alive.exists() and (tmp_path / ("f" * 32) / "launcher.so").exists()
    for key, paths in (("a" * 32, good), ("b" * 32, foreign)):
        assert triton_cache.FileCacheManager(key).get_group("k.json") == paths  # still hits
    assert triton_cache.FileCacheManager("e" * 32).get_group("k.json") is None
    assert sweep_triton_cache(tmp_path) == []  # nothing more to take
    assert sweep_triton_cache(tmp_path / "nowhere") == []

"""Triton's installation hash kept across restarts (engine/worker/triton_key.py): a process whose
installation stamp matches the kept one never hashes Triton's library; any other file content
makes Triton compute it again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.worker.triton_key import installation_stamp

pytest.importorskip("triton.runtime.cache")

PROBE = """
import json, sys
from pathlib import Path
from triton.runtime import cache
real = cache.triton_key
from engine.worker.triton_key import prime_triton
how = prime_triton(Path(sys.argv[1]))
print(json.dumps({"how": how, "key": cache.triton_key(), "hashed": real.cache_info().misses}))
"""


def _start(path: Path) -> dict:
    r = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_the_second_process_takes_the_kept_key_without_hashing(tmp_path: Path) -> None:
    path = tmp_path / "engine" / "triton-key.json"
    first = _start(path)
    assert first["how"] == "computed" and first["hashed"] == 1 and len(first["key"]) > 64
    assert json.loads(path.read_text())["key"] == first["key"]
    second = _start(path)
    assert second == {"how": "kept", "key": first["key"], "hashed": 0}


@pytest.mark.parametrize("content", ['{"stamp": "another installation", "key": "stale"}', '{"stamp": 1}',
                                     "not json", "x" * (70 << 10)])
def test_a_stale_or_damaged_file_is_computed_again_and_replaced(tmp_path: Path, content: str) -> None:
    path = tmp_path / "triton-key.json"
    path.write_text(content)
    got = _start(path)
    assert got["how"] == "computed" and got["hashed"] == 1 and got["key"] != "stale"
    assert json.loads(path.read_text())["key"] == got["key"]


def test_the_stamp_follows_every_file_but_not_bytecode(tmp_path: Path) -> None:
    (tmp_path / "_C").mkdir()
    lib = tmp_path / "_C" / "libtriton.so"
    lib.write_bytes(b"\x7fELF" * 10)
    (tmp_path / "cache.py").write_text("x = 1\n")
    stamp = installation_stamp(tmp_path)
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "cache.cpython-311.pyc").write_bytes(b"pyc")
    assert installation_stamp(tmp_path) == stamp
    lib.write_bytes(b"\x7fELF" * 11)  # a rebuilt library
    assert installation_stamp(tmp_path) != stamp

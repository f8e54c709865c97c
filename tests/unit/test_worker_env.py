"""The worker's environment (agent/worker/options.py): bytecode cached under the cache dir only
where the installation has none, and then written even under PYTHONDONTWRITEBYTECODE; an
operator's prefix kept. ``has_bytecode`` on a real package, before and after compiling it."""

from __future__ import annotations

import py_compile
import subprocess
import sys

from agent.config import load_settings
from agent.worker import options as wo


def test_has_bytecode_of_a_real_package(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg_without_pyc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "pycache_prefix", None)
    assert not wo.has_bytecode("pkg_without_pyc")
    py_compile.compile(str(pkg / "__init__.py"), cfile=None, doraise=True)
    assert wo.has_bytecode("pkg_without_pyc")
    assert wo.has_bytecode("no_such_module_here")  # nothing to compile


def test_the_prefix_only_where_torch_has_no_bytecode(tmp_path, monkeypatch):
    monkeypatch.setenv("INFIRE_CACHE__DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    settings = load_settings(None)
    monkeypatch.setattr(wo, "has_bytecode", lambda m: False)
    env = wo.worker_env(settings)
    assert env["PYTHONPYCACHEPREFIX"] == str(tmp_path / "cache" / "pycache")
    assert "PYTHONDONTWRITEBYTECODE" not in env
    assert str(tmp_path / "cache" / "pycache") in wo.worker_options(settings)["sandbox_options"]["read_write"]
    # What that environment does to a real interpreter: the bytecode lands under the prefix.
    subprocess.run([sys.executable, "-c", "import agent.units"], env=env, check=True)
    assert list((tmp_path / "cache" / "pycache").rglob("agent/units.*.pyc"))
    monkeypatch.setattr(wo, "has_bytecode", lambda m: True)  # pip wrote it: nothing changes
    env = wo.worker_env(settings)
    assert "PYTHONPYCACHEPREFIX" not in env and env["PYTHONDONTWRITEBYTECODE"] == "1"
    monkeypatch.setattr(wo, "has_bytecode", lambda m: False)
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", "/operators/own")
    assert wo.worker_env(settings)["PYTHONPYCACHEPREFIX"] == "/operators/own"

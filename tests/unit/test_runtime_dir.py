"""One default runtime dir (the admin socket's folder) for the daemon and the CLI alike."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.config import Settings, default_runtime_dir


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR", "INFIRE_SERVER__RUNTIME_DIR", "INFIRE_CONFIG"):
        monkeypatch.delenv(k, raising=False)


def test_root_without_systemd_uses_the_units_runtime_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    """`infire-agent status` as root finds the service's /run/infire/admin.sock."""
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert default_runtime_dir() == Path("/run/infire")
    assert Settings().server.admin_socket_path() == Path("/run/infire/admin.sock")


def test_a_user_session_uses_its_runtime_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_runtime_dir() == tmp_path / "infire"


def test_a_user_without_a_session_gets_a_per_uid_tmp_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(os, "getuid", lambda: 1000)
    assert default_runtime_dir() == Path("/tmp/infire-1000")

"""``systemd/agent.toml.example``, the config file the README and docs/operations.md point at:
the real loader accepts it as shipped and with each commented alternative (R2, MinIO, models)
switched on, and it shows every setting."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from agent.config import ModelSettings, Settings, load_settings

EXAMPLE = Path(__file__).resolve().parents[2] / "systemd" / "agent.toml.example"


@pytest.fixture(autouse=True)
def _no_infire_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("INFIRE_"):
            monkeypatch.delenv(k)


def _alternatives(text: str) -> dict[str, list[str]]:
    """Commented blocks that start with ``#[table]`` or ``#[[table]]``, uncommented, keyed by
    the comment paragraph just above them."""
    out: dict[str, list[str]] = {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if re.match(r"^#\[\[?\w+\]\]?$", lines[i]):
            j = i
            while j > 0 and lines[j - 1].startswith("# "):
                j -= 1
            title = " ".join(ln[2:] for ln in lines[j:i])
            block = []
            while i < len(lines) and lines[i].startswith("#") and not lines[i].startswith("# "):
                block.append(lines[i][1:])
                i += 1
            out[title] = block
        i += 1
    return out


def _load(tmp_path: Path, text: str) -> Settings:
    f = tmp_path / "agent.toml"
    f.write_text(text)
    return load_settings(f)


def _without_table(text: str, table: str) -> str:
    """The text without the active ``[table]`` section (its header up to the next header)."""
    return re.sub(rf"(?ms)^\[{table}\]\n.*?(?=^\[)", "", text)


def test_the_example_loads_as_shipped() -> None:
    s = load_settings(EXAMPLE)
    assert s.server.port == 8080 and s.server.host == "127.0.0.1"
    assert s.store.url == "file:///var/lib/infire/store" and s.gpu.memory_budget == 0.9
    assert s.cache.max_bytes == 100 * 1024**3 and s.engine.sandbox and s.models == []


def test_every_setting_is_shown() -> None:
    text = EXAMPLE.read_text()
    for name, field in Settings.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            assert re.search(rf"^\[{name}\]$", text, re.M), f"no [{name}] section"
            for key in ann.model_fields:
                assert re.search(rf"^#?{key} = ", text, re.M), f"{name}.{key} is not shown"
        elif name == "models":
            for key in ModelSettings.model_fields:
                assert re.search(rf"^#\s+{key}\s", text, re.M), f"models[].{key} is not described"
        else:
            assert re.search(rf"^{name} = ", text, re.M), f"{name} is not shown"


def test_r2_store_alternative_loads(tmp_path: Path) -> None:
    text = EXAMPLE.read_text()
    r2 = next(b for t, b in _alternatives(text).items() if "R2" in t)
    s = _load(tmp_path, _without_table(text, "store") + "\n" + "\n".join(r2) + "\n")
    assert s.store.url == "s3://models/infire" and s.store.region == "auto" and not s.store.path_style
    assert re.fullmatch(r"https://<ACCOUNT_ID>\.r2\.cloudflarestorage\.com", s.store.endpoint_url)


def test_minio_store_alternative_loads(tmp_path: Path) -> None:
    text = EXAMPLE.read_text()
    minio = next(b for t, b in _alternatives(text).items() if "MinIO" in t)
    s = _load(tmp_path, _without_table(text, "store") + "\n" + "\n".join(minio) + "\n")
    assert s.store.url.startswith("s3://") and s.store.path_style and s.store.endpoint_url.startswith("http://")


def test_models_alternative_loads(tmp_path: Path) -> None:
    text = EXAMPLE.read_text()
    models = next(b for b in _alternatives(text).values() if b[0] == "[[models]]")
    s = _load(tmp_path, text + "\n" + "\n".join(models) + "\n")
    first, second = s.models
    assert first.name == "llama-3.1-8b" and first.preload and first.pin and first.keep_alive == -1
    assert second.autoload is True and second.max_queue == 512 and second.keep_alive == 600.0

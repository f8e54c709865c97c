"""Settings: defaults with no file, TOML, env overrides, and one clear line per bad key."""

from __future__ import annotations

import pytest

from agent.config import ConfigError, load_settings
from agent.units import parse_duration, parse_fraction_or_size, parse_size


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for k in list(os.environ):
        if k.startswith("INFIRE_"):
            monkeypatch.delenv(k)


def test_defaults_need_no_file():
    s = load_settings()
    assert s.server.host == "127.0.0.1" and s.server.port == 8080
    assert s.gpu.memory_budget == pytest.approx(0.9)
    assert s.cache.max_bytes == 100 * 1024**3
    assert s.models == []
    assert s.server.admin_socket_path().name == "admin.sock"


def test_toml_then_env(tmp_path, monkeypatch):
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        '[cache]\nmax_bytes = "20GiB"\n[gpu]\nmemory_budget = "60GiB"\n'
        '[[models]]\nname = "llama-3.1-8b"\nkeep_alive = "5m"\npin = true\n'
    )
    s = load_settings(cfg)
    assert s.cache.max_bytes == 20 * 1024**3
    assert s.gpu.memory_budget == 60 * 1024**3
    assert s.models[0].keep_alive == 300 and s.models[0].pin
    monkeypatch.setenv("INFIRE_CACHE__MAX_BYTES", "1GB")
    monkeypatch.setenv("INFIRE_ADMIN_TOKEN", "s3cret")
    s = load_settings(cfg)
    assert s.cache.max_bytes == 10**9
    assert s.server.admin_token.get_secret_value() == "s3cret"


def test_models_as_json_env(monkeypatch):
    monkeypatch.setenv("INFIRE_MODELS", '[{"name": "a"}, {"name": "b", "preload": true}]')
    s = load_settings()
    assert [m.name for m in s.models] == ["a", "b"] and s.models[1].preload


def test_a_model_may_ask_for_fp8_weights_and_kv_cache(monkeypatch):
    monkeypatch.setenv("INFIRE_MODELS", '[{"name": "a", "quantization": "fp8", "kv_cache_dtype": "fp8"}, {"name": "b"}]')
    a, b = load_settings().models
    assert (a.quantization, a.kv_cache_dtype) == ("fp8", "fp8") and (b.quantization, b.kv_cache_dtype) == (None, None)


def test_config_file_from_env(tmp_path, monkeypatch):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[server]\nport = 9999\n")
    monkeypatch.setenv("INFIRE_CONFIG", str(cfg))
    assert load_settings().server.port == 9999


@pytest.mark.parametrize(
    "env,key",
    [
        ({"INFIRE_GPU__MEMORY_BUDGET": "90x"}, "gpu.memory_budget"),
        ({"INFIRE_GPU__MEMORY_BUDGET": "150%"}, "gpu.memory_budget"),
        ({"INFIRE_SERVER__PORT": "70000"}, "server.port"),
        ({"INFIRE_CACHE__MAX_BYTES": "-5GB"}, "cache.max_bytes"),
        ({"INFIRE_MODELS": '[{"name": "../etc"}]'}, "models.0.name"),
        ({"INFIRE_MODELS": '[{"name": "a", "keep_alive": "soon"}]'}, "models.0.keep_alive"),
        ({"INFIRE_MODELS": '[{"name": "a"}, {"name": "a"}]'}, "models"),
        ({"INFIRE_STORE__URL": "http://x"}, "store.url"),
        ({"INFIRE_MODELS": '[{"name": "a", "quantization": "int4"}]'}, "models.0.quantization"),
        ({"INFIRE_MODELS": '[{"name": "a", "kv_cache_dtype": "fp16"}]'}, "models.0.kv_cache_dtype"),
    ],
)
def test_bad_values_name_the_key(monkeypatch, env, key):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError) as e:
        load_settings()
    line = str(e.value).splitlines()[0]
    assert line.startswith(f"config error: {key}:"), line


def test_unknown_key_in_file_is_refused(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[cache]\nmax_byte = 5\n")
    with pytest.raises(ConfigError, match="cache.max_byte"):
        load_settings(cfg)


def test_missing_or_broken_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[cache\n")
    with pytest.raises(ConfigError):
        load_settings(bad)


def test_units():
    assert parse_size("200GiB") == 200 * 1024**3
    assert parse_size("1.5 GB") == 1_500_000_000
    assert parse_size(1024) == 1024
    assert parse_fraction_or_size("90%") == pytest.approx(0.9)
    assert parse_duration("1h30m") == 5400 and parse_duration("250ms") == 0.25
    assert parse_duration(-1) == -1
    for bad in ("", "GiB", "1e9000", "5 parsecs"):
        with pytest.raises(ValueError):
            parse_size(bad)
    for bad in ("5x", "m5", "-3s"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_the_quiet_window_reaches_the_worker_and_is_bounded(monkeypatch):
    from agent.worker.options import worker_options

    assert worker_options(load_settings())["quiet_window_ms"] == 1000  # the measured default
    assert worker_options(load_settings())["shared_step_tokens"] == 512
    monkeypatch.setenv("INFIRE_ENGINE__QUIET_WINDOW_MS", "500")
    assert worker_options(load_settings())["quiet_window_ms"] == 500
    monkeypatch.setenv("INFIRE_ENGINE__QUIET_WINDOW_MS", "0")
    assert worker_options(load_settings())["quiet_window_ms"] == 0  # off
    monkeypatch.setenv("INFIRE_ENGINE__QUIET_WINDOW_MS", "60001")
    with pytest.raises(ConfigError, match="quiet_window_ms"):
        load_settings()

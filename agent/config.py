"""Settings: defaults < TOML file (``--config`` / ``INFIRE_CONFIG``) < ``INFIRE_*`` env vars.

Nested keys use ``__`` in the environment (``INFIRE_CACHE__MAX_BYTES=200GiB``); the model list
may be given as JSON in ``INFIRE_MODELS``. ``INFIRE_ADMIN_TOKEN`` is accepted as a short alias of
``INFIRE_SERVER__ADMIN_TOKEN``. Bad values fail at start with :class:`ConfigError`, one line per
bad key, naming it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

from agent.units import parse_duration, parse_fraction_or_size, parse_size
from engine.load_spec import LoadSpec
from engine.options import EngineOptions

MODEL_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")

ByteSize = Annotated[int, BeforeValidator(parse_size)]
Seconds = Annotated[float, BeforeValidator(parse_duration)]
Budget = Annotated[float | int, BeforeValidator(parse_fraction_or_size)]


class ConfigError(Exception):
    """A setting is missing or wrong; the message names the key."""


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def default_runtime_dir() -> Path:
    """systemd's RuntimeDirectory, else the user's XDG runtime dir, else /run/infire for root
    (the unit's RuntimeDirectory=), else /tmp.

    The one place both the daemon (its admin socket) and the CLI (where it looks for that
    socket) take it from: ``serve``, ``demo`` and ``status`` in the same environment meet."""
    if os.environ.get("RUNTIME_DIRECTORY"):
        return Path(os.environ["RUNTIME_DIRECTORY"].split(":")[0])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "infire"
    if _is_root():
        return Path("/run/infire")
    return Path("/tmp") / f"infire-{os.getuid() if hasattr(os, 'getuid') else 'user'}"


def default_cache_dir() -> Path:
    if os.environ.get("CACHE_DIRECTORY"):
        return Path(os.environ["CACHE_DIRECTORY"].split(":")[0])
    if _is_root():
        return Path("/var/cache/infire")
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "infire"


def default_store_url() -> str:
    if os.environ.get("STATE_DIRECTORY"):
        return (Path(os.environ["STATE_DIRECTORY"].split(":")[0]) / "store").as_uri()
    if _is_root():
        return "file:///var/lib/infire/store"
    return (Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share")) / "infire" / "store").as_uri()


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class ServerSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    admin_socket: Path | None = None  # None → <runtime dir>/admin.sock
    admin_token: SecretStr = SecretStr("")
    api_keys: list[SecretStr] = Field(default_factory=list, max_length=1024)
    max_body_bytes: ByteSize = 8 * 1024 * 1024
    max_header_bytes: ByteSize = 16 * 1024
    max_headers: int = Field(100, ge=8, le=1000)
    keepalive_timeout: Seconds = 75.0
    # A request's headers must all arrive within this long of its first byte (of the connection's
    # opening for the first request); a connection that trickles them is closed.
    header_timeout: Seconds = Field(10.0, gt=0, le=3600.0)
    # Open client connections on the TCP port; over it a new one gets a 503 and is closed.
    # None: the file-descriptor limit (RLIMIT_NOFILE) less the headroom the worker socket, the
    # admin socket and the cache need (agent/http/connections.py).
    max_connections: int | None = Field(None, ge=1, le=1 << 20)
    drain_timeout: Seconds = 30.0
    # On: a load that needs a busy model's room preempts it at once when all its requests can
    # resume (they leave the engine and come back with their output so far once it is loaded
    # again: their streams pause) instead of waiting for them to end. Off (the default): a load
    # drains, stepping that model's requests ahead of every other's. Off because on the H200
    # (twelve 8Bs, a 64 GiB warm tier, 4 req/s, docs/perf.md 2026-12-07) every preemption brought
    # a comeback load: 68 loads against 52, TTFT <= 2 s 80.7 % against 86.4 %.
    preempt_for_room: bool = False
    # A request for a configured model that is not loaded loads it, pulling it first when it is
    # only in the store (per model: models[].autoload); off, such a request is a 503.
    autoload: bool = True
    autoload_timeout: Seconds = 60.0  # how long such a request waits for the load before a 503
    # A worker that sent no frame (its heartbeat thread writes every 0.5 s) for this long is
    # killed and replaced; its requests end with an error naming why.
    worker_hang_timeout: Seconds = Field(30.0, ge=2.0, le=3600.0)
    runtime_dir: Path = Field(default_factory=default_runtime_dir)

    def admin_socket_path(self) -> Path:
        return self.admin_socket or self.runtime_dir / "admin.sock"


class StoreSettings(_Section):
    url: str = Field(default_factory=default_store_url)
    endpoint_url: str = ""
    region: str = "auto"
    path_style: bool = False

    @field_validator("url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        if not (v.startswith("file://") or v.startswith("s3://")):
            raise ValueError(f"{v!r}: the store URL must start with file:// or s3://")
        return v


class CacheSettings(_Section):
    dir: Path = Field(default_factory=default_cache_dir)
    max_bytes: ByteSize = parse_size("100GiB")


class GpuSettings(_Section):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    memory_budget: Budget = 0.9  # fraction of the device, or bytes ("60GiB"); bytes on CPU
    cpu_memory_budget: ByteSize = parse_size("4GiB")  # the budget when the engine runs on CPU
    warm_tier_bytes: ByteSize = 0


class EngineSettings(_Section):
    """The engine's switches; every default is :class:`engine.options.EngineOptions`' (the one
    place they live, with what each does and why it is set so)."""

    max_num_batched_tokens: int = Field(EngineOptions.max_num_batched_tokens, ge=16, le=1 << 20)
    decode_step_tokens: int = Field(EngineOptions.decode_step_tokens, ge=1, le=1 << 20)
    page_bytes: ByteSize | None = EngineOptions.page_bytes  # None: the first load sets it
    cuda_graphs: bool = EngineOptions.cuda_graphs
    async_steps: bool = EngineOptions.async_steps
    shared_step_tokens: int = Field(EngineOptions.shared_step_tokens, ge=0, le=1 << 20)
    quiet_window_ms: int = Field(EngineOptions.quiet_window_ms, ge=0, le=60_000)
    sandbox: bool = True


class ModelSettings(_Section):
    name: str
    preload: bool = False
    pin: bool = False
    keep_alive: Seconds = 300.0  # -1: never unload when idle
    # None: the model's own context (config.json), capped by what the GPU budget holds for one
    # sequence beside the models loaded (the cap is logged); a number caps it
    max_model_len: int | None = Field(None, ge=16, le=1 << 20)
    max_num_seqs: int = Field(256, ge=1, le=4096)
    weight: float = Field(1.0, gt=0, le=1000)  # share of GPU time when models compete
    autoload: bool | None = None  # None: server.autoload
    max_queue: int | None = Field(None, ge=1, le=1 << 20)  # requests in flight; None: 2 × max_num_seqs
    prefix_caching: bool = True  # prompts sharing a prefix reuse its KV pages (docs/engine.md)
    # None: weights in the checkpoint's dtype; "fp8": e4m3 projections quantized at load, half
    # the bytes (needs FP8 tensor cores: compute capability 8.9+; docs/engine.md)
    quantization: Literal["fp8"] | None = None
    # None: the KV cache in the model's dtype; "fp8": e4m3, twice the tokens in the same pages
    kv_cache_dtype: Literal["fp8"] | None = None

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        if not MODEL_NAME_RE.fullmatch(v):
            raise ValueError(f"{v!r} is not a model name (^[a-z0-9][a-z0-9._-]{{0,127}}$)")
        return v

    def load_spec(self, model_dir: str | Path) -> LoadSpec:
        """The engine's load of this model from ``model_dir`` (its snapshot): built here once and
        carried whole to the engine's loader (engine/load_spec.py). Raises EngineError for a
        value the engine refuses whatever it holds (``max_num_seqs`` 1)."""
        return LoadSpec(self.name, str(model_dir), self.max_model_len, self.max_num_seqs, self.weight,
                        prefix_caching=self.prefix_caching, quantization=self.quantization,
                        kv_cache_dtype=self.kv_cache_dtype)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="INFIRE_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    server: ServerSettings = Field(default_factory=ServerSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    gpu: GpuSettings = Field(default_factory=GpuSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    models: list[ModelSettings] = Field(default_factory=list, max_length=256)
    log_format: Literal["auto", "json", "console"] = "auto"
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("models")
    @classmethod
    def _unique_names(cls, v: list[ModelSettings]) -> list[ModelSettings]:
        seen: set[str] = set()
        for m in v:
            if m.name in seen:
                raise ValueError(f"model {m.name!r} is listed twice")
            seen.add(m.name)
        return v

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # toml_file is None unless load_settings made a subclass naming one.
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls))

    def model(self, name: str) -> ModelSettings | None:
        return next((m for m in self.models if m.name == name), None)


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"config error: {key}: {msg}")
    return "\n".join(lines)


def load_settings(config_file: str | os.PathLike[str] | None = None, **overrides: Any) -> Settings:
    """Build Settings from defaults, the TOML file and the environment.

    Raises ConfigError with one line per bad key.
    """
    path = config_file or os.environ.get("INFIRE_CONFIG") or None
    toml_path: Path | None = None
    if path:
        toml_path = Path(path)
        if not toml_path.is_file():
            raise ConfigError(f"config error: config file {str(toml_path)!r} does not exist")
    cls: type[Settings] = Settings
    if toml_path is not None:

        class FileSettings(Settings):
            model_config = SettingsConfigDict(**{**Settings.model_config, "toml_file": toml_path})

        cls = FileSettings
    try:
        settings = cls(**overrides)
    except ValidationError as e:
        raise ConfigError(_format_error(e)) from None
    except ValueError as e:  # TOML syntax errors surface as ValueError subclasses
        raise ConfigError(f"config error: {toml_path}: {e}") from None
    token_alias = os.environ.get("INFIRE_ADMIN_TOKEN")
    if token_alias and not settings.server.admin_token.get_secret_value():
        settings.server.admin_token = SecretStr(token_alias)
    return settings

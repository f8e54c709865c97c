"""The agent ↔ engine worker IPC protocol.

Wire format: each frame is a 4-byte big-endian length followed by that many bytes of msgpack.
The msgpack body is a map ``{"v": PROTOCOL_VERSION, "t": <type tag>, ...fields}``. Only plain
msgpack types cross (ints, floats, strings, bytes, lists, maps, nil, bools): never pickle, so a
compromised worker can at worst send a well-formed but wrong message, never run code in the
agent.

Every message is a small frozen dataclass registered under a short tag. Decoding is strict:
an unknown version or tag, a missing field, a field of the wrong type or a frame longer than
``MAX_FRAME_BYTES`` raises :class:`ProtocolError`; unknown *extra* fields are ignored so a newer
peer may add optional fields within one protocol version.

A field typed as a dataclass (a *record*: a load's spec, a request's sampling, a model's info)
crosses as a map and is decoded by the same rules, field by field, into that dataclass; so do
``list[X]`` items and ``dict[str, X]`` values. A record whose constructor refuses its values
(``__post_init__`` bounds) is a ProtocolError. One typed value per concept, never a loose map.

Direction: the agent sends Load, Unload, Expedite, Add, Abort, Shutdown; the worker sends Hello (first),
Loaded, Unloaded, Tokens (one per engine step, carrying every request's new ids), Status
(periodic, doubles as the engine-progress heartbeat), Heartbeat (from a side thread, proves the
process is alive even while the main loop is inside a long load) and Error.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import struct
import time
import types
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union, get_args, get_origin, get_type_hints

import msgpack

from engine.errors import EngineError
from engine.load_spec import LoadSpec
from engine.model_info import ModelInfo
from engine.sampling import SamplingParams
from engine.stats import MemoryStats, ModelStats, WarmTierStats

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 64 * 1024 * 1024  # a 1M-token prompt as int32-ish msgpack fits with room
_HEADER = struct.Struct(">I")
HEADER_BYTES = _HEADER.size


class ProtocolError(Exception):
    """A frame or message that does not follow the protocol; the connection should be dropped."""


# Filled once at import by @_register and read-only afterwards.
_REGISTRY: dict[str, type[Message]] = {}


@dataclass(frozen=True)
class Message:
    TAG: ClassVar[str] = ""

    def to_wire(self) -> dict[str, Any]:
        body = {"v": PROTOCOL_VERSION, "t": self.TAG}
        for f in dataclasses.fields(self):
            body[f.name] = _wire_value(getattr(self, f.name))
        return body


def _wire_value(value: Any) -> Any:
    """A record as its map (recursively); containers of records likewise; the rest unchanged
    (the hot ``Tokens`` lists pass through without a copy when they hold no record)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _wire_value(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict) and value and _has_record(next(iter(value.values()))):
        return {k: _wire_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and value and _has_record(value[0]):
        return [_wire_value(v) for v in value]
    if isinstance(value, tuple):
        return list(value)
    return value


def _has_record(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


@functools.cache
def _record_fields(cls: type) -> tuple[tuple[str, Any, bool], ...]:
    """(name, type hint, required) of a dataclass's init fields, resolved once per type."""
    hints = get_type_hints(cls)
    return tuple((f.name, hints[f.name],
                  f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                 for f in dataclasses.fields(cls) if f.init)


@functools.cache
def _holds_record(hint: Any) -> bool:
    """Whether a value of ``hint`` can contain a record: only then are a container's items walked
    (a prompt's ids are checked by the engine, not once more here)."""
    if dataclasses.is_dataclass(hint):
        return True
    return any(_holds_record(a) for a in get_args(hint))


def _register(cls: type[Message]) -> type[Message]:
    if not cls.TAG or cls.TAG in _REGISTRY:
        raise ValueError(f"bad or duplicate message tag {cls.TAG!r}")  # programming error at import
    _REGISTRY[cls.TAG] = cls
    _record_fields(cls)  # resolved at import: a bad hint fails here, not on the first frame
    return cls


# --- agent → worker ---------------------------------------------------------------------------


@_register
@dataclass(frozen=True)
class Load(Message):
    """Load a model from a local snapshot folder, as ``spec`` says (a record: every load
    parameter in one value, engine/load_spec.py). Answered by Loaded or Error(op="load")."""

    TAG: ClassVar[str] = "load"
    spec: LoadSpec
    # Loaded models the agent would evict for this load, least recently used first (idle,
    # unpinned). A refusal names the shortest prefix that makes room in Error.details["evict"].
    evictable: list[str] = field(default_factory=list)

    @property
    def model(self) -> str:
        return self.spec.name


@_register
@dataclass(frozen=True)
class Unload(Message):
    """Unload a model; its remaining requests finish with "abort". Answered by Unloaded."""

    TAG: ClassVar[str] = "unload"
    model: str


@_register
@dataclass(frozen=True)
class Expedite(Message):
    """``on``: step ``model``'s requests ahead of every other model's until it has none left (it
    drains: the agent admits nothing more to it); off: in turn again (its drain was called off).
    No answer; a model not loaded is ignored."""

    TAG: ClassVar[str] = "expedite"
    model: str
    on: bool


@_register
@dataclass(frozen=True)
class Add(Message):
    """Admit one request; ``sampling`` is a record (its bounds are checked as it is decoded);
    ``grammar``, when not empty, constrains its output (an llguidance grammar,
    agent/http/structured.py). ``output_token_ids``: the output a request already had when its
    model was preempted for another's room (agent/worker/generation.py): it resumes after them,
    as the scheduler resumes a sequence it preempted (recomputed, counted as output)."""

    TAG: ClassVar[str] = "add"
    req_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # Optional within version 1: an older peer sends none.
    grammar: str = ""
    output_token_ids: list[int] = field(default_factory=list)


@_register
@dataclass(frozen=True)
class Abort(Message):
    """Abort requests by id (unknown or finished ids are ignored). Many per frame on purpose:
    a burst of disconnects costs one frame."""

    TAG: ClassVar[str] = "abort"
    req_ids: list[str]


@_register
@dataclass(frozen=True)
class Shutdown(Message):
    TAG: ClassVar[str] = "shutdown"


# --- worker → agent ---------------------------------------------------------------------------


@_register
@dataclass(frozen=True)
class Hello(Message):
    """First frame from the worker once its engine exists (or failed to exist: ``engine_error``)."""

    TAG: ClassVar[str] = "hello"
    pid: int
    device: str
    engine_error: str = ""
    budget_bytes: int = 0  # the engine's memory budget (0: none known)
    # The worker's start as ``[name, start_s, seconds]`` entries, in seconds since its own exec
    # (:func:`seconds_since_exec`), in order. Optional within version 1: an older peer sends none.
    startup: list[list[Any]] = field(default_factory=list)


@_register
@dataclass(frozen=True)
class Loaded(Message):
    """``info``: the model as the engine runs it (vocab_size, max_model_len, eos_token_ids, ...)."""

    TAG: ClassVar[str] = "loaded"
    model: str
    info: ModelInfo
    seconds: float
    # The engine loader's last_load_timings of this load: each phase's seconds (config_s, weights_s, ...).
    # Optional within version 1: an older peer sends none.
    timings: dict[str, Any] = field(default_factory=dict)


@_register
@dataclass(frozen=True)
class Unloaded(Message):
    TAG: ClassVar[str] = "unloaded"
    model: str


@_register
@dataclass(frozen=True)
class DropPrefixCache(Message):
    """Forget a loaded model's prefix cache. Answered by PrefixCacheDropped or
    Error(op="drop_prefix_cache")."""

    TAG: ClassVar[str] = "drop_prefix_cache"
    model: str


@_register
@dataclass(frozen=True)
class PrefixCacheDropped(Message):
    TAG: ClassVar[str] = "prefix_cache_dropped"
    model: str
    entries: int  # index entries forgotten


@_register
@dataclass(frozen=True)
class Tokens(Message):
    """All outputs of one engine step. Each entry of ``outputs`` is
    ``[req_id, new_token_ids, finish_reason | None, logprobs | None, num_prompt_tokens,
    num_cached_tokens]``: positional lists, not maps, because this is the hot message."""

    TAG: ClassVar[str] = "tokens"
    step: int
    outputs: list[list[Any]]


@dataclass(frozen=True)
class TokenOutput:
    """One request's share of a Tokens frame, unpacked."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    logprobs: list[Any] | None
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    prompt_logprobs: list[Any] | None = None  # with the first token, when the request asked


def unpack_outputs(msg: Tokens) -> list[TokenOutput]:
    out: list[TokenOutput] = []
    for entry in msg.outputs:
        if not isinstance(entry, list) or len(entry) not in (6, 7):
            raise ProtocolError("tokens: each output must be a list of 6 or 7 items")
        req_id, ids, finish, logprobs, n_prompt, n_cached = entry[:6]
        plp = entry[6] if len(entry) == 7 else None
        if (not isinstance(req_id, str) or not isinstance(ids, list) or not isinstance(n_prompt, int)
                or not isinstance(n_cached, int) or not 0 <= n_cached <= n_prompt):
            raise ProtocolError("tokens: bad output entry")
        if finish is not None and finish not in ("stop", "length", "abort"):
            raise ProtocolError(f"tokens: bad finish_reason {finish!r}")
        if plp is not None and (not isinstance(plp, list) or len(plp) != max(0, n_prompt - 1)):
            raise ProtocolError("tokens: prompt_logprobs must be a list of one entry per prompt token after the first")
        out.append(TokenOutput(req_id, ids, finish, logprobs, n_prompt, n_cached, plp))
    return out


STARTUP_PHASES_MAX = 32  # entries a Hello.startup carries at most
TIMINGS_MAX = 64  # keys a Loaded.timings carries at most
_NAME_MAX = 64


def seconds_since_exec() -> float:
    """Seconds since this process was exec'd (Linux): the clock of ``Hello.startup``. The
    kernel's start time of the process is in clock ticks since boot, so it is read against the
    boot-time clock, not the wall clock (whose offset from boot is only known to a second)."""
    return time.monotonic() - exec_monotonic()


def exec_monotonic() -> float:
    """When this process was exec'd, on the monotonic clock: the boot-time and monotonic clocks
    are read back to back, after the /proc read (a preemption between ``time.monotonic()`` and
    :func:`seconds_since_exec`'s file read would otherwise move every phase later by its length)."""
    with open(f"/proc/{os.getpid()}/stat", "rb") as f:
        stat = f.read().rsplit(b")", 1)[1].split()
    start = int(stat[19]) / os.sysconf("SC_CLK_TCK")
    boot, mono = time.clock_gettime(time.CLOCK_BOOTTIME), time.monotonic()
    return mono - (boot - start)


def _seconds(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def unpack_startup(msg: Hello) -> list[tuple[str, float, float]]:
    """``Hello.startup`` checked: at most ``STARTUP_PHASES_MAX`` ``(name, start_s, seconds)``,
    names short strings, figures finite and non-negative."""
    if len(msg.startup) > STARTUP_PHASES_MAX:
        raise ProtocolError(f"hello: more than {STARTUP_PHASES_MAX} startup phases")
    out: list[tuple[str, float, float]] = []
    for entry in msg.startup:
        if not isinstance(entry, list) or len(entry) != 3:
            raise ProtocolError("hello: each startup phase must be a list of 3 items")
        name, start, seconds = entry
        if not isinstance(name, str) or not 0 < len(name) <= _NAME_MAX or not (_seconds(start) and _seconds(seconds)):
            raise ProtocolError("hello: bad startup phase")
        out.append((name, float(start), float(seconds)))
    return out


def unpack_timings(msg: Loaded) -> dict[str, float]:
    """``Loaded.timings`` checked: at most ``TIMINGS_MAX`` short names to finite, non-negative seconds."""
    if len(msg.timings) > TIMINGS_MAX:
        raise ProtocolError(f"loaded: more than {TIMINGS_MAX} timings")
    for name, seconds in msg.timings.items():
        if not isinstance(name, str) or not 0 < len(name) <= _NAME_MAX or not _seconds(seconds):
            raise ProtocolError("loaded: bad timing")
    return {name: float(seconds) for name, seconds in msg.timings.items()}


def pack_output(req_id: str, ids: list[int], finish: str | None, logprobs: Any, n_prompt: int,
                n_cached: int = 0, prompt_logprobs: Any = None) -> list[Any]:
    """One request's share of a Tokens frame; ``prompt_logprobs`` (with a first token, when
    asked) makes it 7 items, else 6 as version 1 always had."""
    out = [req_id, ids, finish, logprobs, n_prompt, n_cached]
    if prompt_logprobs is not None:
        out.append(prompt_logprobs)
    return out


@_register
@dataclass(frozen=True)
class Status(Message):
    """Periodic engine state from the main loop. ``steps`` grows with every engine step, so an
    agent that sees it stuck while ``busy`` knows the engine is wedged, not just alive."""

    TAG: ClassVar[str] = "status"
    steps: int
    busy: bool
    models: dict[str, ModelStats] = field(default_factory=dict)  # EngineCore.stats()
    # EngineCore.memory(), at most STATUS_MEMORY_MODELS model rows (MemoryStats.largest): the budget
    # and who holds it, in bytes. None: no engine; optional within version 1 (an older peer sends none).
    memory: MemoryStats | None = None
    # WarmTier.stats(): the host tier's budget, pinned share and contents. None: no warm tier
    # (or no engine); optional within version 1.
    warm_tier: WarmTierStats | None = None


@_register
@dataclass(frozen=True)
class Heartbeat(Message):
    """From the worker's side thread. ``phase`` is "idle", "stepping" or "loading:<model>"."""

    TAG: ClassVar[str] = "heartbeat"
    seq: int
    phase: str
    phase_seconds: float


@_register
@dataclass(frozen=True)
class Error(Message):
    """A command failed. ``op`` is the command's tag; ``req_id``/``model`` say which one."""

    TAG: ClassVar[str] = "error"
    op: str
    message: str
    code: str = "internal"
    req_id: str = ""
    model: str = ""
    # Structured figures of a refusal. A load that does not fit (code "no_room") carries
    # needed, free, evictable, budget, short (bytes) and evict (model names to unload first).
    details: dict[str, Any] = field(default_factory=dict)


def plain(obj: Any) -> Any:
    """A msgpack-safe copy: map keys become strings (peers decode with strict keys), numpy and
    torch scalars plain numbers."""
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars
        return obj.item()
    return obj


STATUS_MEMORY_MODELS = 64  # memory rows a Status carries at most (a Status stays small)


# --- encoding ---------------------------------------------------------------------------------


def encode(msg: Message) -> bytes:
    """One frame: length prefix + msgpack body."""
    body = msgpack.packb(msg.to_wire(), use_bin_type=True)
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"{msg.TAG}: frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return _HEADER.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    """The body length from a 4-byte header, refusing oversize frames before reading them."""
    if len(header) != HEADER_BYTES:
        raise ProtocolError("short frame header")
    (n,) = _HEADER.unpack(header)
    if n > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {n} bytes exceeds {MAX_FRAME_BYTES}")
    return n


_ABSENT = object()


def _typed(value: Any, hint: Any, where: str) -> Any:
    """``value`` checked against ``hint`` (records built, containers walked where their items
    are typed); raises ProtocolError naming ``where``."""
    if hint is Any:
        return value
    origin = get_origin(hint)
    if origin is Union or origin is types.UnionType:
        if value is None and type(None) in get_args(hint):
            return None
        arms = [arm for arm in get_args(hint) if arm is not type(None)]
        if len(arms) == 1:  # X | None: X's own error names the bad field inside a record
            return _typed(value, arms[0], where)
        for arm in get_args(hint):
            if arm is type(None):
                continue
            try:
                return _typed(value, arm, where)
            except ProtocolError:
                continue
        raise ProtocolError(f"{where}: unexpected type {type(value).__name__}")
    if hint is type(None):
        if value is not None:
            raise ProtocolError(f"{where}: expected nil")
        return None
    if origin is list or hint is list:
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: unexpected type {type(value).__name__}")
        args = get_args(hint)
        if not args or not _holds_record(args[0]):
            return value
        return [_typed(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: unexpected type {type(value).__name__}")
        args = get_args(hint)
        if not args or not _holds_record(args[1]):
            return value
        return {_typed(k, args[0], where): _typed(v, args[1], f"{where}[{k!r}]") for k, v in value.items()}
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected a map, got {type(value).__name__}")
        return _build(hint, value, where)
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, hint):
        return value
    raise ProtocolError(f"{where}: unexpected type {type(value).__name__}")


def _build(cls: type, obj: dict[str, Any], where: str) -> Any:
    """A dataclass from a decoded map: every known field typed, required ones present, extra
    keys ignored; the constructor's own refusal (bounds) becomes a ProtocolError."""
    kwargs: dict[str, Any] = {}
    for name, hint, required in _record_fields(cls):
        value = obj.get(name, _ABSENT)
        if value is not _ABSENT:
            kwargs[name] = _typed(value, hint, f"{where}.{name}")
        elif required:
            raise ProtocolError(f"{where}: missing field {name!r}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError, EngineError) as e:
        raise ProtocolError(f"{where}: {e}") from None


def decode(body: bytes) -> Message:
    """A message from one frame body (without the length prefix)."""
    try:
        obj = msgpack.unpackb(
            body, raw=False, strict_map_key=True, use_list=True,
            ext_hook=_refuse_ext,
        )
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable frame: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("a frame must hold a map")
    if obj.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {obj.get('v')!r}, expected {PROTOCOL_VERSION}")
    cls = _REGISTRY.get(obj.get("t"))  # type: ignore[arg-type]
    if cls is None:
        raise ProtocolError(f"unknown message type {obj.get('t')!r}")
    return _build(cls, obj, cls.TAG)


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not allowed")


class FrameDecoder:
    """Incremental decoder for a byte stream: ``feed(data)`` returns the complete messages."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Message]:
        self._buf += data
        out: list[Message] = []
        pos = 0
        buf = self._buf
        while len(buf) - pos >= HEADER_BYTES:
            n = frame_length(bytes(buf[pos : pos + HEADER_BYTES]))
            if len(buf) - pos - HEADER_BYTES < n:
                break
            start = pos + HEADER_BYTES
            out.append(decode(bytes(buf[start : start + n])))
            pos = start + n
        if pos:
            del buf[:pos]
        return out

    @property
    def pending_bytes(self) -> int:
        return len(self._buf)

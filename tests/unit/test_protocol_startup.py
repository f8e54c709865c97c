"""The worker's start record on the wire: Hello.startup and Loaded.timings are optional (an
older peer on either side still talks), checked when unpacked, and on the exec clock."""

from __future__ import annotations

import subprocess
import sys
import time

import msgpack
import pytest

from engine.model_info import ModelInfo
from engine.worker import protocol as P

INFO = ModelInfo("m", 100, 64, [2], 1000, 10, 16)


def _decode(obj: dict) -> P.Message:
    return P.decode(msgpack.packb(obj, use_bin_type=True))


def test_hello_and_loaded_carry_the_start_record_both_ways() -> None:
    hello = P.Hello(pid=3, device="cpu", startup=[["python", 0.0, 0.05], ["engine_imports", 0.05, 1.5]])
    back = P.decode(P.encode(hello)[4:])
    assert back == hello and P.unpack_startup(back) == [("python", 0.0, 0.05), ("engine_imports", 0.05, 1.5)]
    loaded = P.Loaded(model="m", info=INFO, seconds=0.5, timings={"weights_s": 0.25, "total_s": 0.5})
    assert P.unpack_timings(P.decode(P.encode(loaded)[4:])) == {"weights_s": 0.25, "total_s": 0.5}


def test_an_older_peer_without_the_fields_still_decodes() -> None:
    hello = _decode({"v": 1, "t": "hello", "pid": 3, "device": "cpu"})
    assert isinstance(hello, P.Hello) and P.unpack_startup(hello) == []
    loaded = _decode({"v": 1, "t": "loaded", "model": "m", "info": P._wire_value(INFO), "seconds": 0.1})
    assert isinstance(loaded, P.Loaded) and P.unpack_timings(loaded) == {}


@pytest.mark.parametrize("startup, why", [
    ("python", "unexpected type"),
    ([["python", 0.0]], "3 items"),
    ([["", 0.0, 1.0]], "bad startup phase"),
    ([["x" * 65, 0.0, 1.0]], "bad startup phase"),
    ([["python", -1.0, 1.0]], "bad startup phase"),
    ([["python", 0.0, float("nan")]], "bad startup phase"),
    ([["python", 0.0, True]], "bad startup phase"),
    ([["p", 0.0, 0.1]] * (P.STARTUP_PHASES_MAX + 1), "more than"),
])
def test_a_bad_startup_record_is_a_protocol_error(startup: object, why: str) -> None:
    with pytest.raises(P.ProtocolError, match=why):
        P.unpack_startup(_decode({"v": 1, "t": "hello", "pid": 3, "device": "cpu", "startup": startup}))


@pytest.mark.parametrize("timings, why", [
    ({"weights_s": "fast"}, "bad timing"),
    ({"weights_s": float("inf")}, "bad timing"),
    ({"": 1.0}, "bad timing"),
    ({f"t{i}": 0.1 for i in range(P.TIMINGS_MAX + 1)}, "more than"),
])
def test_bad_load_timings_are_a_protocol_error(timings: dict, why: str) -> None:
    with pytest.raises(P.ProtocolError, match=why):
        P.unpack_timings(_decode({"v": 1, "t": "loaded", "model": "m", "info": P._wire_value(INFO), "seconds": 0.1,
                                  "timings": timings}))


def test_seconds_since_exec_counts_from_the_process_start() -> None:
    # A fresh interpreter that sleeps before reading its age: at least the sleep, and not the
    # age of this (older) test process.
    code = "import time; time.sleep(0.3); from engine.worker.protocol import seconds_since_exec as s; print(s())"
    t0 = time.monotonic()
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 0.3 <= age <= time.monotonic() - t0 + 0.02  # the kernel's start time is in 10 ms ticks
    assert P.seconds_since_exec() > 0


def test_the_exec_on_the_monotonic_clock_is_when_the_parent_started_it() -> None:
    """The monotonic clock is the machine's: a child's exec lies between its parent's spawn and
    its answer (less the kernel's 10 ms tick: the start time is truncated to it)."""
    code = "from engine.worker.protocol import exec_monotonic as e; print(repr(e()))"
    for _ in range(3):
        t0 = time.monotonic()
        got = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
        assert t0 - 0.011 <= got <= time.monotonic()

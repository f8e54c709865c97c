"""The IPC wire format: round trips, strict decoding, frame bounds, no pickle."""

from __future__ import annotations

import pickle
import re
import struct
from dataclasses import dataclass, field

import msgpack
import pytest

from engine.load_spec import LoadSpec
from engine.model_info import ModelInfo
from engine.sampling import SamplingParams
from engine.worker import protocol as P
from tests.records import model_stats


def _body(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize(
    "msg",
    [
        P.Add(req_id="r1", model="m", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(temperature=0.0, seed=7)),
        P.Abort(req_ids=["a", "b"]),
        P.Load(spec=LoadSpec("m", "/x", max_model_len=128, max_num_seqs=4, weight=2.0)),
        P.Unload(model="m"),
        P.Expedite(model="m", on=True),
        P.Shutdown(),
        P.Hello(pid=12, device="cpu"),
        P.Loaded(model="m", info=ModelInfo("m", 100, 64, [2, 3], 1 << 20, 12, 16, "fp8", None), seconds=0.5),
        P.Unloaded(model="m"),
        P.Tokens(step=3, outputs=[P.pack_output("r1", [5, 6], None, None, 3), P.pack_output("r2", [], "abort", None, 1)]),
        P.Status(steps=9, busy=True, models={"m": model_stats(running=2, prefix_caching=True, yield_wait_s=0.5)}),
        P.Heartbeat(seq=1, phase="loading:m", phase_seconds=1.5),
        P.Error(op="add", message="bad", code="EngineError", req_id="r1"),
    ],
)
def test_round_trip(msg: P.Message) -> None:
    frame = P.encode(msg)
    assert struct.unpack(">I", frame[:4])[0] == len(frame) - 4
    assert P.decode(frame[4:]) == msg


def test_decoder_handles_split_and_coalesced_frames() -> None:
    msgs = [P.Abort(req_ids=[str(i)]) for i in range(5)]
    stream = b"".join(P.encode(m) for m in msgs)
    dec = P.FrameDecoder()
    got: list[P.Message] = []
    for i in range(0, len(stream), 3):  # 3-byte pieces cut through headers and bodies
        got.extend(dec.feed(stream[i : i + 3]))
    assert got == msgs and dec.pending_bytes == 0
    assert P.FrameDecoder().feed(stream) == msgs


def test_unpack_outputs() -> None:
    msg = P.Tokens(step=1, outputs=[P.pack_output("r", [1], "length", [[-0.1]], 4)])
    (out,) = P.unpack_outputs(msg)
    assert out == P.TokenOutput("r", [1], "length", [[-0.1]], 4)
    with pytest.raises(P.ProtocolError):
        P.unpack_outputs(P.Tokens(step=1, outputs=[["r", [1], "exploded", None, 4, 0]]))
    with pytest.raises(P.ProtocolError):  # more cached than prompt tokens
        P.unpack_outputs(P.Tokens(step=1, outputs=[["r", [1], None, None, 4, 5]]))
    with pytest.raises(P.ProtocolError):
        P.unpack_outputs(P.Tokens(step=1, outputs=[["r", [1]]]))


@pytest.mark.parametrize(
    "obj, why",
    [
        ([1, 2], "map"),
        ({"v": 99, "t": "abort", "req_ids": []}, "version"),
        ({"t": "abort", "req_ids": []}, "version"),
        ({"v": 1, "t": "launch_missiles"}, "unknown message type"),
        ({"v": 1, "t": "add", "req_id": "r", "model": "m", "sampling": {}}, "missing field"),
        ({"v": 1, "t": "add", "req_id": 5, "model": "m", "prompt_token_ids": [], "sampling": {}}, "unexpected type"),
        ({"v": 1, "t": "hello", "pid": True, "device": "cpu"}, "unexpected type"),
        ({"v": 1, "t": "status", "steps": 1, "busy": True, "models": {1: {}}}, "undecodable"),
    ],
)
def test_strict_decoding(obj: object, why: str) -> None:
    with pytest.raises(P.ProtocolError, match=why):
        P.decode(_body(obj))


def test_extra_fields_are_ignored_within_a_version() -> None:
    body = _body({"v": 1, "t": "unload", "model": "m", "future_field": 1})
    assert P.decode(body) == P.Unload(model="m")


def test_refuses_pickle_and_extension_types() -> None:
    with pytest.raises(P.ProtocolError):
        P.decode(pickle.dumps(P.Unload(model="m")))
    with pytest.raises(P.ProtocolError, match="extension"):
        P.decode(_body({"v": 1, "t": "unload", "model": msgpack.ExtType(1, b"x")}))


def test_frame_size_bounds() -> None:
    with pytest.raises(P.ProtocolError, match="exceeds"):
        P.frame_length(struct.pack(">I", P.MAX_FRAME_BYTES + 1))
    with pytest.raises(P.ProtocolError, match="exceeds"):
        P.FrameDecoder().feed(struct.pack(">I", 0xFFFFFFFF) + b"x")
    with pytest.raises(P.ProtocolError, match="exceeds"):
        P.encode(P.Add(req_id="r", model="m", prompt_token_ids=[], sampling=SamplingParams(),
                       grammar="\0" * (P.MAX_FRAME_BYTES + 1)))
    with pytest.raises(P.ProtocolError):
        P.frame_length(b"\0\0")


# --- records: typed values nested in a message ---------------------------------------------------

@dataclass(frozen=True)
class _Inner:
    n: int
    tag: str | None = None

    def __post_init__(self) -> None:
        if self.n < 0:
            raise ValueError("n must be >= 0")


@dataclass(frozen=True)
class _Outer:
    inner: _Inner
    rows: list[_Inner] = field(default_factory=list)
    by_name: dict[str, _Inner] = field(default_factory=dict)
    ids: list[int] = field(default_factory=list)


def test_a_record_crosses_as_a_map_and_comes_back_as_its_type() -> None:
    out = _Outer(_Inner(1, "a"), [_Inner(2)], {"m": _Inner(3, "c")}, [5, 6])
    wire = P._wire_value(out)
    assert wire == {"inner": {"n": 1, "tag": "a"}, "rows": [{"n": 2, "tag": None}],
                    "by_name": {"m": {"n": 3, "tag": "c"}}, "ids": [5, 6]}
    assert P._typed(msgpack.unpackb(msgpack.packb(wire)), _Outer, "x") == out


@pytest.mark.parametrize("wire, why", [
    ({"inner": {"n": "1"}}, "x.inner.n: unexpected type str"),
    ({"inner": {}}, "x.inner: missing field 'n'"),
    ({"inner": {"n": -1}}, "x.inner: n must be >= 0"),  # the record's own bounds
    ({"inner": [1]}, "x.inner: expected a map"),
    ({"inner": {"n": 1}, "rows": [{"n": True}]}, "x.rows[0].n: unexpected type bool"),
    ({"inner": {"n": 1}, "by_name": {"m": 3}}, "x.by_name['m']: expected a map"),
    ({"inner": {"n": 1}, "ids": {"a": 1}}, "x.ids: unexpected type dict"),
])
def test_a_record_is_decoded_strictly_naming_the_field(wire: dict, why: str) -> None:
    with pytest.raises(P.ProtocolError, match=re.escape(why)):
        P._typed(wire, _Outer, "x")


def test_a_record_ignores_extra_keys_within_a_version() -> None:
    assert P._typed({"inner": {"n": 1, "later": 2}, "new": 0}, _Outer, "x") == _Outer(_Inner(1))


def test_model_info_crosses_whole_and_strictly() -> None:
    info = ModelInfo("m", 100, 64, [2], 1000, 10, 16)
    wire = P.Loaded(model="m", info=info, seconds=0.1).to_wire()
    assert set(wire["info"]) == {f for f in ModelInfo.__dataclass_fields__}  # every field, always
    back = P.decode(msgpack.packb(wire, use_bin_type=True))
    assert isinstance(back, P.Loaded) and back.info == info and isinstance(back.info, ModelInfo)
    del wire["info"]["vocab_size"]
    with pytest.raises(P.ProtocolError, match="loaded.info: missing field 'vocab_size'"):
        P.decode(msgpack.packb(wire, use_bin_type=True))

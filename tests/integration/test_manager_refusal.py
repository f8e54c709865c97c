"""The structured load refusal the manager plans with: the engine's numbers through the worker's
helper and across the wire (in-process, CPU, tiny models)."""

from __future__ import annotations

import pytest

from engine.worker import protocol as P
from engine.errors import EngineError
from engine.worker.load_refusal import accepts_evictable, refusal_details
from engine.load_spec import LoadSpec
from tests.integration.manager_helpers import CTX, SEQS, budget_for_two


@pytest.fixture(scope="module")
def full_core(make_tiny_model):
    """An engine holding two models under a budget that has no room for a third."""
    from engine.core.engine_core import EngineCore
    from engine.options import EngineOptions

    src = make_tiny_model("llama")
    core = EngineCore(EngineOptions(max_num_batched_tokens=2048), device="cpu", budget=budget_for_two(src, 2048))
    for n in ("old", "new"):
        core.load_model(LoadSpec(n, str(src), max_model_len=CTX, max_num_seqs=SEQS))
    return core, str(src)


def _refuse(core, src: str, offered: list[str]) -> dict:
    kw = {"evictable": offered} if offered and accepts_evictable(core) else {}
    with pytest.raises(EngineError) as ex:
        core.load_model(LoadSpec("third", src, max_model_len=CTX, max_num_seqs=SEQS), **kw)
    d = refusal_details(core, ex.value, LoadSpec("third", src, max_model_len=CTX, max_num_seqs=SEQS), offered=offered)
    assert d is not None, ex.value
    return d


def test_refusal_names_the_shortest_lru_prefix(full_core) -> None:
    core, src = full_core
    d = _refuse(core, src, ["old", "new"])
    assert d["evict"] == ["old"], d  # one model's room is enough: only the least recently used
    assert d["needed"] > d["free"] and d["budget"] > d["needed"] and d["evictable"] > 0, d
    assert d["short"] == 0


def test_refusal_without_an_offer_has_the_numbers_and_no_cure(full_core) -> None:
    core, src = full_core
    d = _refuse(core, src, [])
    assert d["evict"] == [] and d["evictable"] == 0 and d["short"] == d["needed"] - d["free"] > 0, d
    assert "third" not in core.stats()  # nothing was left behind


def test_other_failures_are_not_room_refusals(full_core, tmp_path) -> None:
    core, _ = full_core
    with pytest.raises(EngineError) as ex:
        core.load_model(LoadSpec("broken", str(tmp_path), max_model_len=CTX, max_num_seqs=SEQS))
    assert refusal_details(core, ex.value, LoadSpec("broken", str(tmp_path), max_model_len=CTX, max_num_seqs=SEQS),
                           offered=["old"]) is None


def test_a_failure_of_the_load_itself_is_never_called_a_room_refusal(full_core) -> None:
    """However full the engine is, an error that is not the ledger's refusal (a CUDA error in a
    graph capture, say) is answered as itself, never as "no room" with estimated numbers."""
    core, src = full_core
    spec = LoadSpec("third", src, max_model_len=CTX, max_num_seqs=SEQS)
    for err in (EngineError("decode graph capture failed: CUDA error"), RuntimeError("CUDA error: capture")):
        assert refusal_details(core, err, spec, offered=["old", "new"]) is None


def test_an_unrunnable_load_option_is_not_a_room_refusal(full_core) -> None:
    """A quantization or KV dtype the engine refuses (here: unknown ones; on a GPU without FP8,
    fp8) says why; it never asks the agent to evict, however full the budget is."""
    core, src = full_core
    for kw in ({"quantization": "int4"}, {"kv_cache_dtype": "int8"}):
        with pytest.raises(EngineError) as ex:
            core.load_model(LoadSpec("third", src, max_model_len=CTX, max_num_seqs=SEQS, **kw), evictable=["old"])
        assert "is not supported" in str(ex.value)
        assert refusal_details(core, ex.value, LoadSpec("third", src, max_model_len=CTX, max_num_seqs=SEQS),
                               offered=["old"]) is None, kw
    assert set(core.stats()) == {"old", "new"}


def test_wire_fields_round_trip_and_default_for_older_peers() -> None:
    load = P.Load(spec=LoadSpec("m", "/x"), evictable=["a", "b"])
    assert P.decode(P.encode(load)[P.HEADER_BYTES:]) == load
    err = P.Error(op="load", message="no room", code="no_room", model="m",
                  details={"needed": 5, "free": 1, "evictable": 3, "budget": 9, "short": 1, "evict": ["a"]})
    assert P.decode(P.encode(err)[P.HEADER_BYTES:]) == err
    old = {"v": P.PROTOCOL_VERSION, "t": "load", "spec": {"name": "m", "model_dir": "/x"}}  # a peer without the field
    import msgpack

    assert P.decode(msgpack.packb(old)).evictable == []
    with pytest.raises(P.ProtocolError):
        P.decode(msgpack.packb({**old, "evictable": "a"}))

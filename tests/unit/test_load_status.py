"""The engine's memory split in the worker's Status: bounded, integers only, optional in v1."""

from __future__ import annotations

import msgpack

from engine.worker import protocol as P


def _memory(n: int) -> dict:
    models = {f"m{i}": {"weights": i, "workspace": 2, "kv_min": 3, "kv_used": 4, "kv_pages_used": 5,
                        "kv_pages_total": 6, "extra": "dropped"} for i in range(n)}
    return {"budget": 100, "used": 60, "free": 40, "weights": 30, "workspace": 10, "kv": 20, "kv_used": 5,
            "page_bytes": 2, "kv_pages": 10, "kv_pages_free": 7, "models": models}


def test_status_memory_round_trips_and_is_bounded():
    mem = P.status_memory(_memory(3))
    assert mem["budget"] == 100 and mem["models_omitted"] == 0
    assert mem["models"]["m2"] == {"weights": 2, "workspace": 2, "kv_min": 3, "kv_used": 4, "kv_pages_used": 5,
                                   "kv_pages_total": 6}
    msg = P.Status(steps=1, busy=False, models={}, memory=mem)
    [back] = P.FrameDecoder().feed(P.encode(msg))
    assert back == msg
    big = P.status_memory(_memory(P.STATUS_MEMORY_MODELS + 5))
    assert len(big["models"]) == P.STATUS_MEMORY_MODELS and big["models_omitted"] == 5
    assert "m0" not in big["models"]  # the smallest go first


def test_a_status_without_memory_still_decodes():
    body = P.Status(steps=3, busy=True).to_wire()
    del body["memory"]
    frame = msgpack.packb(body, use_bin_type=True)
    got = P.decode(frame)
    assert isinstance(got, P.Status) and got.memory == {}

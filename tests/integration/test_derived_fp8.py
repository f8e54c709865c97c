"""FP8 quantized once (issue 35, swaps): a cached model's FP8 checkpoint built in the background
beside its snapshot, exactly what a load computes, kept whole or not at all. Real files, a real
file store and disk cache, the real writer in a subprocess."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from safetensors.torch import load_file

from agent.manager.model_source import CacheSource
from cache.derived import RECORD, DerivedError, DerivedStore
from cache.disk_cache import DiskCache
from cache.file_store import FileStore
from cache.publish import publish_model
from engine.kernels.fp8 import quantize_weight

SCHEME = "fp8-channel"
SRC = "a" * 64


def _folder(path, files: dict[str, bytes]):
    path.mkdir(parents=True)
    for name, data in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    return path


def test_an_artifact_is_served_only_whole(tmp_path):
    store = DerivedStore(tmp_path / "cache")
    assert store.lookup(SCHEME, SRC) is None
    built = _folder(store.building(SCHEME, SRC), {"config.json": b"{}", "w/model.safetensors": b"x" * 100})
    path = store.commit(SCHEME, SRC, built)
    assert store.lookup(SCHEME, SRC) == path and not built.exists()
    assert store.verify(SCHEME, SRC) == [] and store.used_bytes() > 100
    rec = json.loads((path / RECORD).read_text())
    assert rec["version"] == 1 and rec["source"] == SRC and len(rec["files"]) == 2
    (path / "w" / "model.safetensors").write_bytes(b"y" * 100)  # same size, other bytes
    assert store.lookup(SCHEME, SRC) == path  # sizes are checked at every use ...
    assert store.verify(SCHEME, SRC) == ["w/model.safetensors: sha256 mismatch"]  # ... digests on verify
    assert store.lookup(SCHEME, SRC) is None and not path.exists()  # and a damaged one is gone
    built = _folder(store.building(SCHEME, SRC), {"config.json": b"{}"})
    path = store.commit(SCHEME, SRC, built)
    (path / "config.json").write_bytes(b"{}  ")  # another size
    assert store.lookup(SCHEME, SRC) is None and not path.exists()


@pytest.mark.parametrize("record", [b"not json", b'{"version": 2}', json.dumps(
    {"version": 1, "scheme": SCHEME, "source": SRC,
     "files": [{"path": "../escape", "size": 1, "sha256": "0" * 64}]}).encode()])
def test_a_record_that_does_not_describe_its_artifact_is_removed(tmp_path, record):
    store = DerivedStore(tmp_path / "cache")
    path = store.commit(SCHEME, SRC, _folder(store.building(SCHEME, SRC), {"config.json": b"{}"}))
    (path / RECORD).write_bytes(record)
    assert store.lookup(SCHEME, SRC) is None and not path.exists()


def test_bad_names_are_refused_before_anything_is_touched(tmp_path):
    store = DerivedStore(tmp_path / "cache")
    with pytest.raises(DerivedError):
        store.lookup("int4", SRC)
    with pytest.raises(DerivedError):
        store.lookup(SCHEME, "../x")
    assert not (tmp_path / "cache").exists()


def test_sweep_keeps_what_a_cached_model_still_needs(tmp_path):
    store = DerivedStore(tmp_path / "cache")
    keep, drop = "b" * 64, "c" * 64
    for src in (keep, drop):
        store.commit(SCHEME, src, _folder(store.building(SCHEME, src), {"config.json": b"{}"}))
    dead = store.root / SCHEME / f".{drop}.partial-999999999"
    _folder(dead, {"x": b"1"})
    assert store.sweep({keep}) > 0
    assert store.lookup(SCHEME, keep) is not None and store.lookup(SCHEME, drop) is None and not dead.exists()


async def test_the_first_fp8_load_builds_the_checkpoint_a_load_would_compute(tmp_path, make_tiny_model):
    src_dir = make_tiny_model("llama")
    store = FileStore(tmp_path / "store")
    publish_model(store, src_dir, "m", also_as=("n",))
    cache = DiskCache(tmp_path / "cache", 1 << 30)
    source = CacheSource(cache, store)
    try:
        await source.pull("m")
        await source.pull("n")  # the same files: one artifact serves both names
        assert source.derived("m", SCHEME) is None
        source.want_derived("m", SCHEME)
        source.want_derived("n", SCHEME)  # on its way (one build at a time): not a second
        await asyncio.wait_for(asyncio.gather(*source._builds.values()), 120)
        out = source.derived("m", SCHEME)
        assert out is not None and source.derived("n", SCHEME) == out and len(source._builds) == 1
        assert "quantization_config" in json.loads((out / "config.json").read_text())
        want = load_file(str(src_dir / "model.safetensors"))
        got = load_file(str(out / "model.safetensors"))
        proj = [k for k in want if k.endswith(("q_proj.weight", "down_proj.weight"))]
        assert proj
        for k in proj:  # bit for bit what a load quantizes to
            q, s = quantize_weight(want[k])
            assert torch.equal(got[k].view(torch.uint8), q.view(torch.uint8)), k
            assert torch.equal(got[k[: -len(".weight")] + ".weight_scale"], s[:, None]), k
        assert torch.equal(got["model.embed_tokens.weight"], want["model.embed_tokens.weight"])
        assert not cache.is_pinned("m")  # pinned only while it was read
        assert [p.name for p in (tmp_path / "cache" / "derived" / SCHEME).iterdir()] == [out.name]
    finally:
        await source.close_builds()
        source.close()


async def test_a_build_that_fails_leaves_nothing(tmp_path, make_tiny_model):
    src_dir = make_tiny_model("llama")
    store = FileStore(tmp_path / "store")
    publish_model(store, src_dir, "m")
    cache = DiskCache(tmp_path / "cache", 1 << 30)
    source = CacheSource(cache, store)
    try:
        snap = await source.pull("m")
        target = snap / "model.safetensors"
        data = target.read_bytes()
        target.write_bytes(b"\xff" * len(data))  # same size, not safetensors: the writer fails
        source.want_derived("m", SCHEME)
        await asyncio.wait_for(asyncio.gather(*source._builds.values()), 120)
        assert source.derived("m", SCHEME) is None
        assert not any((tmp_path / "cache" / "derived" / SCHEME).iterdir())
    finally:
        await source.close_builds()
        source.close()


def test_the_derived_checkpoint_serves_exactly_as_quantizing_at_load(tmp_path, make_tiny_model):
    """What the quantize-once build writes is what a load computes: served from it, every token
    and logprob equals the FP8 load of the unquantized folder."""
    from engine.core.engine_core import EngineCore
    from engine.load_spec import LoadSpec
    from engine.options import EngineOptions
    from engine.sampling import SamplingParams
    from engine.weights.fp8_writer import main as write_fp8

    src = make_tiny_model("llama")
    assert write_fp8([str(src), str(tmp_path / "fp8")]) == 0
    core = EngineCore(EngineOptions(max_num_batched_tokens=128, seed=0), device="cpu")
    core.load_model(LoadSpec("at-load", src, max_model_len=64, max_num_seqs=4, quantization="fp8"))
    info = core.load_model(LoadSpec("derived", tmp_path / "fp8", max_model_len=64, max_num_seqs=4))
    assert info.quantization == "fp8"  # a pre-quantized checkpoint loads as FP8 whatever was asked
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    for model in ("at-load", "derived"):
        core.add_request(model, model, list(range(30, 47)), params)
    got: dict[str, list] = {"at-load": [], "derived": []}
    while core.has_unfinished_requests():
        for o in core.step():
            got[o.req_id] += [(t, lp) for t, lp in zip(o.new_token_ids, o.logprobs or [None] * len(o.new_token_ids))]
    assert len(got["derived"]) == 12 and got["derived"] == got["at-load"]


async def test_a_build_never_takes_the_cache_past_its_quota(tmp_path, make_tiny_model):
    src_dir = make_tiny_model("llama")
    store = FileStore(tmp_path / "store")
    m = publish_model(store, src_dir, "m")
    cache = DiskCache(tmp_path / "cache", int(m.total_size * 1.3))  # the model fits; its FP8 copy does not
    source = CacheSource(cache, store)
    try:
        await source.pull("m")
        source.want_derived("m", SCHEME)
        await asyncio.wait_for(asyncio.gather(*source._builds.values()), 120)
        assert source.derived("m", SCHEME) is None and source.stats()["used_bytes"] <= cache.max_bytes
    finally:
        await source.close_builds()
        source.close()
    big = DiskCache(tmp_path / "cache2", 1 << 30)
    source = CacheSource(big, store)
    try:
        await source.pull("m")
        source.want_derived("m", SCHEME)
        await asyncio.wait_for(asyncio.gather(*source._builds.values()), 120)
        used = source.stats()["used_bytes"]
        assert source.derived("m", SCHEME) is not None and used > m.total_size  # counted in the use
    finally:
        await source.close_builds()
        source.close()


async def test_an_evicted_models_fp8_checkpoint_goes_with_it_and_counts_meanwhile(tmp_path, make_tiny_model):
    store = FileStore(tmp_path / "store")
    m = publish_model(store, make_tiny_model("llama"), "a")
    publish_model(store, make_tiny_model("qwen3"), "b")
    cache = DiskCache(tmp_path / "cache", 1 << 30)
    source = CacheSource(cache, store)
    try:
        await source.pull("a")
        source.want_derived("a", SCHEME)
        await asyncio.wait_for(asyncio.gather(*source._builds.values()), 120)
        art = source.derived("a", SCHEME)
        assert art is not None and cache.used_bytes() > m.total_size + 0.4 * m.total_size  # counted
        await source.pull("b")
        # past the high watermark by a byte: the least recently used model goes, b is kept
        evicted = await cache.evict_to_fit(int(0.95 * (1 << 30)) - cache.used_bytes() + 1, keep=frozenset({"b"}))
        assert evicted == ["a"] and not art.exists()  # its derived checkpoint went with it
    finally:
        await source.close_builds()
        source.close()

"""engine.weights.weight_stream and engine.weights.warm_tier on the GPU: pinned ring + streams, casts, restore."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from safetensors.torch import save_file  # noqa: E402

from cache.safetensors_check import check_file  # noqa: E402
from engine.weights.warm_tier import WarmTier  # noqa: E402
from engine.weights.weight_stream import CopyJob, stream_to_device  # noqa: E402


def test_stream_into_fused_cuda_views(tmp_path):
    g = torch.Generator().manual_seed(0)
    t = {"q": torch.randn(4096, 1024, generator=g).bfloat16(), "k": torch.randn(1024, 1024, generator=g).bfloat16(),
         "v": torch.randn(1024, 1024, generator=g).bfloat16(), "n": torch.randn(1024, generator=g)}
    path = tmp_path / "w.safetensors"
    save_file(t, str(path))
    info = {x.name: x for x in check_file(path).tensors}
    qkv = torch.full((6144 + 64, 1024), float("nan"), dtype=torch.bfloat16, device="cuda")
    n = torch.full((1024,), float("nan"), dtype=torch.bfloat16, device="cuda")
    dests = {"q": qkv[:4096], "k": qkv[4096:5120], "v": qkv[5120:6144], "n": n}
    jobs = [CopyJob(path, info[k].begin, info[k].end - info[k].begin, d, torch.float32 if k == "n" else None)
            for k, d in dests.items()]
    # a small ring (3 chunks of 1 MiB) forces slot reuse while copies are in flight
    stats = stream_to_device(jobs, threads=4, ring_bytes=3 << 20, chunk_bytes=1 << 20, streams=2)
    for k in ("q", "k", "v"):
        assert torch.equal(dests[k].cpu(), t[k]), k
    assert torch.equal(n.cpu(), t["n"].bfloat16())
    assert qkv[6144:].isnan().all()
    assert stats.bytes == sum(x.numel() * x.element_size() for x in t.values())


def test_warm_tier_pinned_round_trip():
    w = {"a": torch.randn(1000, 1000, device="cuda").bfloat16(), "b": torch.randn(77, device="cuda")}
    tier = WarmTier(64 << 20)
    # Before its arena is page-locked the tier stores nothing: a pageable copy of an 8B on an
    # unload's path took 15 s (docs/perf.md); the load reads its files instead.
    assert tier.pin and not tier.put("m", w)
    assert tier.prepin()
    assert tier.put("m", w)
    dst = {k: torch.full_like(v, float("nan")) for k, v in w.items()}
    assert tier.restore("m", dst)
    assert all(torch.equal(dst[k], w[k]) for k in w)
    assert tier.discard("m")


def test_an_unloads_stash_returns_before_its_copies_land_and_nothing_reuses_what_they_read():
    """put_async issues the device-to-host copies on the tier's stream and returns (an unload
    does not wait ~0.3 s on the stepping thread for an 8B). Meanwhile the entry is held (get:
    None), a restore copies only after the landing, and the source's memory — freed at once, as
    an unload that keeps no vacancy frees it — is not handed to a new tensor (written at once on
    the current stream) before the copies have read it."""
    torch.manual_seed(0)
    w = {f"t{i}": torch.randn(64 << 20, device="cuda", dtype=torch.bfloat16) for i in range(4)}  # 512 MiB
    want = {k: v.cpu() for k, v in w.items()}
    tier = WarmTier(1 << 30)
    assert tier.prepin()
    stored, landing = tier.put_async("m", w)
    assert stored and landing is not None
    assert tier.get("m") is None  # held while 512 MiB cross PCIe (tens of ms)
    del w
    junk = [torch.full((64 << 20,), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    dst = {k: torch.empty(64 << 20, device="cuda", dtype=torch.bfloat16) for k in want}
    assert tier.restore("m", dst)
    assert all(torch.equal(dst[k].cpu(), want[k]) for k in want)
    landing.synchronize()
    got = tier.get("m")
    assert got is not None and all(torch.equal(got[k], want[k]) for k in want)
    del junk

"""engine.weights.weight_stream on CPU: bytes land in the right (fused) destinations, through the direct
path and through the ring (tiny chunks and two slots, so slots are recycled many times)."""

from __future__ import annotations

import threading

import pytest
import torch
from safetensors.torch import save_file

from cache.safetensors_check import check_file
from engine.weights.weight_stream import CopyJob, WeightStreamError, stream_to_device


@pytest.fixture()
def shard(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "q": torch.randn(64, 48, generator=g).bfloat16(),
        "k": torch.randn(16, 48, generator=g).bfloat16(),
        "v": torch.randn(16, 48, generator=g).bfloat16(),
        "norm": torch.randn(48, generator=g),  # float32 in the file
        "big": torch.randn(300, 100, generator=g).bfloat16(),  # many 4 KiB chunks
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    infos = {t.name: t for t in check_file(path).tensors}
    return path, tensors, infos


def jobs_for(path, infos, dests, src_dtypes=None):
    src_dtypes = src_dtypes or {}
    return [CopyJob(path, infos[n].begin, infos[n].end - infos[n].begin, d, src_dtypes.get(n))
            for n, d in dests.items()]


@pytest.mark.parametrize("ring", [False, True])
def test_fused_destinations_get_exact_bytes(shard, ring):
    path, tensors, infos = shard
    qkv = torch.full((64 + 16 + 16 + 8, 48), float("nan"), dtype=torch.bfloat16)  # 8 spare rows stay poisoned
    big = torch.full((300, 100), float("nan"), dtype=torch.bfloat16)
    dests = {"q": qkv[:64], "k": qkv[64:80], "v": qkv[80:96], "big": big}
    stats = stream_to_device(jobs_for(path, infos, dests), threads=3, ring_bytes=8192, chunk_bytes=4096,
                             streams=2, use_ring=ring)
    for n in ("q", "k", "v", "big"):
        assert torch.equal(dests[n], tensors[n]), n
    assert qkv[96:].isnan().all()
    assert stats.bytes == sum(t.numel() * 2 for n, t in tensors.items() if n != "norm")
    assert stats.chunks >= 300 * 100 * 2 // 4096


@pytest.mark.parametrize("ring", [False, True])
def test_dtype_cast_on_copy(shard, ring):
    path, tensors, infos = shard
    dst = torch.full((48,), float("nan"), dtype=torch.bfloat16)
    q32 = torch.full((64, 48), float("nan"), dtype=torch.float32)
    jobs = jobs_for(path, infos, {"norm": dst, "q": q32}, {"norm": torch.float32, "q": torch.bfloat16})
    stream_to_device(jobs, threads=2, ring_bytes=8192, chunk_bytes=4096, use_ring=ring)
    assert torch.equal(dst, tensors["norm"].bfloat16())
    assert torch.equal(q32, tensors["q"].float())


@pytest.mark.parametrize("ring", [False, True])
@pytest.mark.parametrize("file_dtype, dst_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                   (torch.bfloat16, torch.bfloat16)])
def test_transposed_jobs_land_each_experts_weight_transposed(tmp_path, ring, file_dtype, dst_dtype):
    """A fused experts tensor [E, K, N] into a stack [E, N, K], one job an expert: staged (even
    with no cast, where an untransposed job would copy straight in) and written transposed; with
    scales, each expert's rows quantized as a per-expert tensor would be."""
    from engine.kernels.fp8 import quantize_weight

    g = torch.Generator().manual_seed(1)
    src = torch.randn(3, 256, 96, generator=g).to(file_dtype)  # [E, K, N] as a checkpoint keeps it
    path = tmp_path / "e.safetensors"
    save_file({"experts": src}, str(path))
    info = check_file(path).tensors[0]
    each = (info.end - info.begin) // 3
    dst = torch.full((3, 96, 256), float("nan"), dtype=dst_dtype)
    jobs = [CopyJob(path, info.begin + e * each, each, dst[e], None if file_dtype == dst_dtype else file_dtype,
                    transposed=True) for e in range(3)]
    stream_to_device(jobs, threads=2, ring_bytes=8192, chunk_bytes=4096, use_ring=ring)
    assert torch.equal(dst, src.transpose(1, 2).to(dst_dtype))
    codes = torch.zeros(3, 96, 256, dtype=torch.float8_e4m3fn)
    scales = torch.zeros(3, 96)
    jobs = [CopyJob(path, info.begin + e * each, each, codes[e], file_dtype, scale=scales[e], transposed=True)
            for e in range(3)]
    stream_to_device(jobs, threads=2, ring_bytes=8192, chunk_bytes=4096, use_ring=ring)
    for e in range(3):
        want, want_s = quantize_weight(src[e].t().float())
        assert torch.equal(codes[e].view(torch.uint8), want.view(torch.uint8)) and torch.equal(scales[e], want_s)


def test_bad_jobs_are_refused_before_any_write(shard, tmp_path):
    path, tensors, infos = shard
    dst = torch.zeros(64, 48, dtype=torch.bfloat16)
    q = infos["q"]
    with pytest.raises(WeightStreamError, match="destination needs"):
        stream_to_device([CopyJob(path, q.begin, q.end - q.begin - 2, dst)])
    with pytest.raises(WeightStreamError, match="file has"):
        stream_to_device([CopyJob(path, path.stat().st_size - 10, dst.numel() * 2, dst)])
    with pytest.raises(WeightStreamError, match="contiguous"):
        stream_to_device([CopyJob(path, q.begin, 48 * 32 * 2, dst[:, :32])])
    with pytest.raises(WeightStreamError, match="cannot stat"):
        stream_to_device([CopyJob(tmp_path / "missing.safetensors", 0, dst.numel() * 2, dst)])
    with pytest.raises(WeightStreamError):
        stream_to_device([], threads=0)
    assert not dst.any()


@pytest.mark.parametrize("ring", [False, True])
def test_read_failure_surfaces_and_stops_threads(tmp_path, ring):
    before = threading.active_count()
    d = tmp_path / "a_dir"
    d.mkdir()
    size = d.stat().st_size
    if size < 16:
        pytest.skip("directory size too small on this filesystem")
    dst = torch.zeros(size // 4, dtype=torch.float32)
    with pytest.raises(WeightStreamError):
        stream_to_device([CopyJob(d, 0, dst.numel() * 4, dst)], threads=2, ring_bytes=8192, chunk_bytes=4096,
                         use_ring=ring)
    assert threading.active_count() == before


def test_empty_and_zero_byte_jobs(shard):
    path, _, _ = shard
    assert stream_to_device([]).bytes == 0
    assert stream_to_device([CopyJob(path, 0, 0, torch.empty(0))]).bytes == 0


class _IntervalProbe(threading.Event):
    """A cancel event that records the GIL switch interval each time a chunk checks it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[float] = []

    def is_set(self) -> bool:
        import sys
        self.seen.append(sys.getswitchinterval())
        return super().is_set()


@pytest.mark.parametrize("ring", [False, True])
def test_the_gil_hands_over_quickly_while_streaming_and_the_interval_comes_back(shard, ring):
    # Beside a thread running Python (the runner's build during a load), every GIL hand-off of a
    # chunk would otherwise wait out Python's 5 ms interval (docs/perf.md: 0.1-0.4 GB/s on the H200).
    import sys

    from engine.weights import weight_stream

    path, tensors, infos = shard
    before = sys.getswitchinterval()
    assert before > weight_stream.SWITCH_INTERVAL_S
    probe = _IntervalProbe()
    big = torch.empty(300, 100, dtype=torch.bfloat16)
    stream_to_device(jobs_for(path, infos, {"big": big}), threads=2, ring_bytes=8192, chunk_bytes=4096,
                     use_ring=ring, cancel=probe)
    assert torch.equal(big, tensors["big"])
    assert probe.seen and set(probe.seen) == {weight_stream.SWITCH_INTERVAL_S}
    assert sys.getswitchinterval() == before
    # a failed stream restores it too
    with pytest.raises(WeightStreamError):
        stream_to_device([CopyJob(path, path.stat().st_size - 10, big.numel() * 2, big)], use_ring=ring)
    assert sys.getswitchinterval() == before

"""Every Triton kernel against its torch reference on the GPU, at real and odd sizes, bf16.

Outputs are poisoned (NaN, or -7 for ids) before each run; inputs are random. Skipped without CUDA.
Run: ``python -m pytest -q tests/gpu/test_kernels.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from engine.kernels import activation, attention, kv_write, norm, rope  # noqa: E402
from engine.kernels.sample import sample_ref  # noqa: E402

DEV = "cuda"
HQ, HKV, D = 32, 8, 128  # Llama-3.1-8B attention heads
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def rel_err(out, ref):
    assert not torch.isnan(out).any(), "NaN in the output: an element was not written"
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def kv_pool(num_pages, block, dtype, layers=4, layer=1):
    """Strided K/V views of one layer of a [pages, layers, 2, block, Hkv, D] pool."""
    pool = torch.randn(num_pages, layers, 2, block, HKV, D, device=DEV, dtype=dtype)
    return pool, pool[:, layer, 0], pool[:, layer, 1]


def batch_meta(q_lens, seq_lens, block, num_pages):
    g = torch.Generator().manual_seed(sum(seq_lens))
    max_pages = max((s + block - 1) // block for s in seq_lens)
    perm = torch.randperm(num_pages, generator=g)
    tables = torch.zeros(len(seq_lens), max_pages, dtype=torch.int32)
    used = 0
    for i, s in enumerate(seq_lens):
        n = (s + block - 1) // block
        tables[i, :n] = perm[used:used + n].to(torch.int32)
        used += n
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return tables.to(DEV), qsl.to(DEV), torch.tensor(seq_lens, dtype=torch.int32, device=DEV)


ATTN_CASES = {
    "one_token": ([1], [1], 16),
    "page_boundaries": ([15, 16, 17, 1, 1], [15, 16, 17, 32, 33], 16),
    "prefill_mixed": ([512, 1, 300, 1, 77], [512, 900, 1400, 17, 77], 16),
    "chunked_8k": ([512], [8192], 16),
    "block1_prefill": ([40, 1, 9], [40, 70, 100], 1),
    "decode_b1_8k": ([1], [8192], 16),
    "decode_b256": ([1] * 256, None, 16),
    "decode_block1": ([1] * 7, [1, 2, 3, 500, 64, 65, 1000], 1),
}


@pytest.mark.parametrize("case", sorted(ATTN_CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_paged_attention(case, dtype):
    from engine.kernels.attention_triton import paged_attention_triton

    q_lens, seq_lens, block = ATTN_CASES[case]
    if seq_lens is None:
        seq_lens = torch.randint(1, 2049, (len(q_lens),), generator=torch.Generator().manual_seed(0)).tolist()
    pages = sum((s + block - 1) // block for s in seq_lens) + 5
    _, kc, vc = kv_pool(pages, block, dtype)
    tables, qsl, sl = batch_meta(q_lens, seq_lens, block, pages)
    q = torch.randn(sum(q_lens), HQ, D, device=DEV, dtype=dtype)
    out = torch.full_like(q, float("nan"))
    scale = 1 / math.sqrt(D)
    paged_attention_triton(q, kc, vc, qsl, sl, tables, scale, max(q_lens), max(seq_lens), out=out)
    ref = attention.paged_attention_ref(q, kc, vc, qsl, sl, tables, scale)
    assert rel_err(out, ref) < 1e-2
    assert (out.float() - ref.float()).abs().max().item() < 5e-2


@pytest.mark.parametrize("chunk", [1024, 1000, 8192])
@pytest.mark.parametrize("fp8_kv", [False, True])
def test_chunked_attention_matches_the_reference_compiled(chunk, fp8_kv):
    """Llama 4's chunked layers on sm_90 code (the CPU tests run the interpreter): a mixed step
    with a 4k prompt deep in a context, decode rows on both sides of chunk boundaries, a chunk
    size that is and is not a multiple of the key tile, bf16 and e4m3 caches."""
    from engine.kernels.attention_triton import paged_attention_triton

    q_lens, seq_lens, block = [4096, 1, 1, 700, 1, 1, 300], [4096, 20000, 8193, 3000, 8192, 1, 9000], 16
    pages = sum((s + block - 1) // block for s in seq_lens) + 5
    _, kc, vc = kv_pool(pages, block, torch.bfloat16)
    if fp8_kv:
        kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    tables, qsl, sl = batch_meta(q_lens, seq_lens, block, pages)
    q = torch.randn(sum(q_lens), HQ, D, device=DEV, dtype=torch.bfloat16)
    scale = 1 / math.sqrt(D)
    ref = attention.paged_attention_ref(q, kc.to(q.dtype), vc.to(q.dtype), qsl, sl, tables, scale, chunk=chunk)
    for splits in (None, 7):
        out = torch.full_like(q, float("nan"))
        paged_attention_triton(q, kc, vc, qsl, sl, tables, scale, max(q_lens), max(seq_lens), out=out,
                               num_splits=splits, chunk=chunk)
        assert rel_err(out, ref) < 1e-2, splits


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_paged_attention_other_dtypes(dtype):
    from engine.kernels.attention_triton import paged_attention_triton

    q_lens, seq_lens = [33, 1, 1], [100, 513, 2]
    pages = 50
    _, kc, vc = kv_pool(pages, 16, dtype)
    tables, qsl, sl = batch_meta(q_lens, seq_lens, 16, pages)
    q = torch.randn(sum(q_lens), HQ, D, device=DEV, dtype=dtype)
    for mql in (max(q_lens), 1):
        n = sum(q_lens) if mql > 1 else 2
        qq = q[-n:] if mql == 1 else q
        qs = qsl if mql > 1 else torch.tensor([0, 0, 1, 2], dtype=torch.int32, device=DEV)
        out = torch.full_like(qq, float("nan"))
        paged_attention_triton(qq, kc, vc, qs, sl, tables, 0.1, mql, 513, out=out)
        ref = attention.paged_attention_ref(qq, kc, vc, qs, sl, tables, 0.1)
        assert rel_err(out, ref) < (1e-3 if dtype == torch.float16 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_large_prefill_tile_with_packed_probabilities(dtype):
    """Enough query tokens for the 256-row, 128-key tile (attention_triton.prefill_shape), whose
    probabilities are computed two at a time in 16 bits (packed_exp): a whole prompt and a
    chunk over cached context, against the reference."""
    from engine.kernels.attention_triton import long_keys, packed_exp, paged_attention_triton, prefill_shape

    q_lens, seq_lens = [1024, 900], [1024, 2000]
    cap = torch.cuda.get_device_capability()
    shape = prefill_shape(sum(q_lens), HQ // HKV, HKV, False, D,
                          torch.cuda.get_device_properties(0).multi_processor_count, long_keys(cap, False, 0))
    assert shape[0] == 256 and packed_exp(shape[0], shape[1], dtype, cap) == (shape[1] == 128), shape
    pages = 200
    _, kc, vc = kv_pool(pages, 16, dtype)
    tables, qsl, sl = batch_meta(q_lens, seq_lens, 16, pages)
    q = torch.randn(sum(q_lens), HQ, D, device=DEV, dtype=dtype)
    out = torch.full_like(q, float("nan"))
    paged_attention_triton(q, kc, vc, qsl, sl, tables, D ** -0.5, max(q_lens), max(seq_lens), out=out)
    ref = attention.paged_attention_ref(q, kc, vc, qsl, sl, tables, D ** -0.5)
    assert rel_err(out, ref) < (2e-3 if dtype == torch.float16 else 1e-2)


@pytest.mark.parametrize("n,block", [(1, 16), (2048, 16), (777, 1)])
def test_write_kv(n, block):
    from engine.kernels.kv_write_triton import write_kv_triton

    pages = (n + block - 1) // block + 8
    pool, kc, vc = kv_pool(pages, block, torch.bfloat16)
    pool.fill_(float("nan"))
    ref_pool = pool.clone()
    k = torch.randn(n, HKV, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.randperm(pages * block, device=DEV)[:n]
    slots[:: 7] = -1
    write_kv_triton(k, v, kc, vc, slots)
    kv_write.write_kv_ref(k, v, ref_pool[:, 1, 0], ref_pool[:, 1, 1], slots)
    assert torch.equal(pool.isnan(), ref_pool.isnan())
    assert torch.equal(pool.nan_to_num(0), ref_pool.nan_to_num(0))


@pytest.mark.parametrize("n,h", [(1, 4096), (257, 4096), (3, 5120), (64, 8192)])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm(n, h, residual):
    from engine.kernels.norm_triton import rms_norm_triton

    x = torch.randn(n, h, device=DEV, dtype=torch.bfloat16)
    r = torch.randn_like(x) if residual else None
    w = torch.randn(h, device=DEV, dtype=torch.bfloat16)
    out, res = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    rms_norm_triton(x, r, w, 1e-5, out=out, res_out=res)
    if residual:
        ref, ref_res = norm.fused_add_rms_norm_ref(x, r, w, 1e-5)
        assert torch.equal(res, ref_res)
    else:
        ref = norm.rms_norm_ref(x, w, 1e-5)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("n", [1, 300, 2048])
def test_silu_and_mul(n):
    from engine.kernels.activation_triton import silu_and_mul_triton

    x = torch.randn(n, 2 * 14336, device=DEV, dtype=torch.bfloat16) * 3
    out = torch.full((n, 14336), float("nan"), device=DEV, dtype=torch.bfloat16)
    silu_and_mul_triton(x, out=out)
    assert rel_err(out, activation.silu_and_mul_ref(x)) < 1e-2


@pytest.mark.parametrize("n", [1, 4099])
def test_rope(n):
    from engine.kernels.rope_triton import apply_rope_triton

    cache = rope.build_cos_sin_cache(D, 131072, 500000.0, LLAMA3, DEV)
    qkv = torch.randn(n, (HQ + 2 * HKV) * D, device=DEV, dtype=torch.bfloat16)
    q, k = qkv[:, :HQ * D].view(n, HQ, D), qkv[:, HQ * D:(HQ + HKV) * D].view(n, HKV, D)
    v_before = qkv[:, (HQ + HKV) * D:].clone()
    pos = torch.randint(0, 131072, (n,), device=DEV)
    q_ref, k_ref = q.clone(), k.clone()
    rope.apply_rope_ref(q_ref, k_ref, pos, cache)
    apply_rope_triton(q, k, pos, cache)
    assert rel_err(q, q_ref) < 1e-2 and rel_err(k, k_ref) < 1e-2
    assert torch.equal(qkv[:, (HQ + HKV) * D:], v_before)


def sample_inputs(b, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, vocab, generator=g) * 4).to(DEV)
    temp = torch.rand(b, generator=g) * 1.3 + 0.3
    temp[::4] = 0.0
    top_k = torch.where(torch.rand(b, generator=g) < 0.4, torch.randint(1, 100, (b,), generator=g), 0).int()
    top_p = torch.where(torch.rand(b, generator=g) < 0.5, torch.rand(b, generator=g) * 0.9 + 0.1, 1.0)
    min_p = torch.where(torch.rand(b, generator=g) < 0.3, torch.rand(b, generator=g) * 0.1, 0.0)
    seeds = torch.randint(-2**62, 2**62, (b,), generator=g)
    steps = torch.randint(0, 4096, (b,), generator=g)
    return [logits] + [t.to(DEV) for t in (temp, top_k, top_p, min_p, seeds, steps)]


@pytest.mark.parametrize("b,vocab", [(1, 128256), (256, 128256), (7, 32000), (3, 151936)])
def test_sample(b, vocab):
    from engine.kernels.sample_triton import sample_triton

    args = sample_inputs(b, vocab, b + vocab)
    out = torch.full((b,), -7, dtype=torch.int64, device=DEV)
    sample_triton(*args, out=out)
    ref = sample_ref(*args)
    greedy = args[1] <= 0
    assert torch.equal(out[greedy], ref[greedy])
    # exp/div may differ by an ulp between torch and triton: allow a rare near-tie to flip
    assert (out != ref).sum().item() <= max(1, b // 100)
    again = sample_triton(*args)
    assert torch.equal(out, again)


def test_decode_step_captures_in_a_cuda_graph():
    """write_kv + rope + attention(decode) + norm + sample replay from a graph with fresh inputs."""
    from engine.kernels import apply_rope, fused_add_rms_norm, paged_attention, sample, write_kv

    b, block, max_len, vocab = 8, 16, 1024, 32000
    pages = b * max_len // block + 1
    _, kc, vc = kv_pool(pages, block, torch.bfloat16)
    seq_lens = list(range(100, 100 + b * 97, 97))
    tables, qsl, sl = batch_meta([1] * b, seq_lens, block, pages)
    cache = rope.build_cos_sin_cache(D, max_len, 5e5, LLAMA3, DEV)
    st = {"q": torch.randn(b, HQ, D, device=DEV, dtype=torch.bfloat16),
          "k": torch.randn(b, HKV, D, device=DEV, dtype=torch.bfloat16),
          "x": torch.randn(b, 4096, device=DEV, dtype=torch.bfloat16),
          "logits": torch.randn(b, vocab, device=DEV)}
    st["v"] = torch.randn_like(st["k"])
    pos = (sl - 1).long()
    slots = (tables.gather(1, (pos // block)[:, None])[:, 0].long() * block + pos % block)
    w = torch.randn(4096, device=DEV, dtype=torch.bfloat16)
    samp = sample_inputs(b, vocab, 1)[1:]

    def step():
        q, k = st["q"].clone(), st["k"].clone()
        apply_rope(q, k, pos, cache)
        write_kv(k, st["v"], kc, vc, slots)
        o = paged_attention(q, kc, vc, qsl, sl, tables, 0.088, 1, max_len)
        y, _ = fused_add_rms_norm(o.view(b, -1), st["x"], w, 1e-5)
        return y, sample(st["logits"], *samp)

    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = step()
    for name, t in st.items():
        t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    e_out = step()
    assert torch.equal(g_out[0], e_out[0]) and torch.equal(g_out[1], e_out[1])

"""The plain-torch kernel references against independent formulations (and transformers for rope)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.kernels import KernelError, build_cos_sin_cache
from engine.kernels.activation import silu_and_mul_ref
from engine.kernels.attention import paged_attention_ref
from engine.kernels.kv_write import write_kv_ref
from engine.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from engine.kernels.rope import apply_rope_ref
from engine.kernels.sample import noise_uniform, sample_ref


def make_pool(num_pages, layers, block, hkv, d, dtype, layer=1):
    """A [pages, layers, 2, block, Hkv, D] pool and strided K/V views of one layer."""
    pool = torch.randn(num_pages, layers, 2, block, hkv, d).to(dtype)
    return pool, pool[:, layer, 0], pool[:, layer, 1]


def build_batch(q_lens, seq_lens, block, num_pages, gen):
    """Random distinct page assignment; returns block_tables, slot_mapping of new tokens, metadata."""
    b = len(q_lens)
    max_pages = max((s + block - 1) // block for s in seq_lens)
    perm = torch.randperm(num_pages, generator=gen)
    tables = torch.zeros(b, max_pages, dtype=torch.int32)
    used = 0
    slots = []
    for i, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        np_ = (sl + block - 1) // block
        tables[i, :np_] = perm[used:used + np_].to(torch.int32)
        used += np_
        for pos in range(sl - ql, sl):
            slots.append(int(tables[i, pos // block]) * block + pos % block)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    return tables, torch.tensor(slots, dtype=torch.int64), qsl, torch.tensor(seq_lens, dtype=torch.int32)


def dense_attention(q, keys, vals, q_lens, seq_lens, scale, chunk=0):
    """Per query token, per head, in float64: the plainest definition (``chunk``: the token at
    ``pos`` sees the positions of its own chunk up to itself)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    hq, hkv = q.shape[1], keys[0].shape[1]
    row = 0
    for b, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        for j in range(ql):
            pos = sl - ql + j
            lo = pos - pos % chunk if chunk else 0
            for h in range(hq):
                kv = h // (hq // hkv)
                kk = keys[b][lo: pos + 1, kv].double()
                s = (kk @ q[row, h].double()) * scale
                out[row, h] = torch.softmax(s, 0) @ vals[b][lo: pos + 1, kv].double()
            row += 1
    return out


@pytest.mark.parametrize("block", [1, 16])
def test_paged_attention_ref_matches_dense(block):
    gen = torch.Generator().manual_seed(block)
    torch.manual_seed(block)
    hq, hkv, d = 4, 2, 8
    q_lens, seq_lens = [5, 1, 3, 1], [5, 20, 19, 1]  # prefill, decode, chunked prefill, 1-token seq
    num_pages = sum((s + block - 1) // block for s in seq_lens) + 3
    pool, kc, vc = make_pool(num_pages, 3, block, hkv, d, torch.float32)
    assert kc.stride(0) == 3 * 2 * block * hkv * d  # the page stride is the whole multi-layer page
    tables, slots, qsl, sl = build_batch(q_lens, seq_lens, block, num_pages, gen)
    keys = [torch.randn(s, hkv, d) for s in seq_lens]
    vals = [torch.randn(s, hkv, d) for s in seq_lens]
    for b, s in enumerate(seq_lens):  # whole context into the pages, through write_kv_ref
        pos = torch.arange(s)
        sm = tables[b, pos // block].long() * block + pos % block
        write_kv_ref(keys[b], vals[b], kc, vc, sm)
    q = torch.randn(sum(q_lens), hq, d)
    scale = 1 / math.sqrt(d)
    out = paged_attention_ref(q, kc, vc, qsl, sl, tables, scale)
    ref = dense_attention(q, keys, vals, q_lens, seq_lens, scale)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # the other layer's halves of the pool were not touched
    assert not torch.isnan(pool).any()


def _paged_batch(block, hq, hkv, d, q_lens, seq_lens, seed):
    """A batch whose whole context is written into shuffled pages of a float32 pool: q, caches,
    tables, metadata and the per-sequence keys and values."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    num_pages = sum((s + block - 1) // block for s in seq_lens) + 3
    _, kc, vc = make_pool(num_pages, 2, block, hkv, d, torch.float32)
    tables, _, qsl, sl = build_batch(q_lens, seq_lens, block, num_pages, gen)
    keys = [torch.randn(s, hkv, d) for s in seq_lens]
    vals = [torch.randn(s, hkv, d) for s in seq_lens]
    for b, s in enumerate(seq_lens):
        pos = torch.arange(s)
        write_kv_ref(keys[b], vals[b], kc, vc, tables[b, pos // block].long() * block + pos % block)
    q = torch.randn(sum(q_lens), hq, d)
    return q, kc, vc, qsl, sl, tables, keys, vals


@pytest.mark.parametrize("block", [1, 16])
@pytest.mark.parametrize("chunk", [1, 4, 7, 16])
def test_chunked_attention_ref_matches_dense(block, chunk):
    """Chunked local attention: a token sees its own chunk up to itself. A prompt over several
    chunks, decode rows on and just past a chunk boundary, a chunk of a prompt over cached
    context that starts mid-chunk, a one-token sequence."""
    q_lens, seq_lens = [37, 1, 1, 1, 9, 1], [37, 32, 33, 50, 40, 1]
    hq, hkv, d = 4, 2, 8
    q, kc, vc, qsl, sl, tables, keys, vals = _paged_batch(block, hq, hkv, d, q_lens, seq_lens, seed=chunk)
    scale = 1 / math.sqrt(d)
    out = paged_attention_ref(q, kc, vc, qsl, sl, tables, scale, chunk=chunk)
    ref = dense_attention(q, keys, vals, q_lens, seq_lens, scale, chunk=chunk)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert (out - paged_attention_ref(q, kc, vc, qsl, sl, tables, scale)).abs().max() > 0.1  # not causal


def test_chunk_bounds_of_the_reference():
    """chunk 1: each token sees only itself (its value, whatever q); a chunk no shorter than every
    context is causal attention exactly; chunk 0 is causal attention."""
    q_lens, seq_lens = [12, 1, 5], [12, 30, 21]
    q, kc, vc, qsl, sl, tables, keys, vals = _paged_batch(16, 4, 2, 8, q_lens, seq_lens, seed=3)
    own = torch.cat([vals[b][s - n:].repeat_interleave(2, dim=1) for b, (n, s) in enumerate(zip(q_lens, seq_lens))])
    torch.testing.assert_close(paged_attention_ref(q, kc, vc, qsl, sl, tables, 0.3, chunk=1), own)
    causal = paged_attention_ref(q, kc, vc, qsl, sl, tables, 0.3)
    assert torch.equal(paged_attention_ref(q, kc, vc, qsl, sl, tables, 0.3, chunk=30), causal)
    assert torch.equal(paged_attention_ref(q, kc, vc, qsl, sl, tables, 0.3, chunk=0), causal)


def test_chunked_attention_refuses_a_cascade_plan_and_a_negative_chunk():
    """A cascade plan reads the shared pages for every row of a group, which a chunked row may
    not see: refused rather than silently wrong (the model passes no plan in chunked layers)."""
    from engine.kernels import paged_attention

    q, kc, vc, qsl, sl, tables, _, _ = _paged_batch(16, 4, 2, 8, [1, 1], [20, 9], seed=4)
    plan = (torch.tensor([[0, 16, 0, 1]], dtype=torch.int32), torch.tensor([16, 0], dtype=torch.int32))
    with pytest.raises(KernelError, match="cascade"):
        paged_attention(q, kc, vc, qsl, sl, tables, 0.3, 1, 20, cascade=plan, chunk=8)
    with pytest.raises(KernelError, match="chunk"):
        paged_attention(q, kc, vc, qsl, sl, tables, 0.3, 1, 20, chunk=-8)
    out = paged_attention(q, kc, vc, qsl, sl, tables, 0.3, 1, 20, chunk=8)
    torch.testing.assert_close(out, paged_attention_ref(q, kc, vc, qsl, sl, tables, 0.3, chunk=8))


def test_write_kv_ref_skips_padding_and_keeps_other_layers():
    pool, kc, vc = make_pool(4, 2, 4, 2, 8, torch.float16, layer=0)
    before = pool.clone()
    k, v = torch.randn(3, 2, 8).half(), torch.randn(3, 2, 8).half()
    write_kv_ref(k, v, kc, vc, torch.tensor([5, -1, 12]))
    assert torch.equal(kc[1, 1], k[0]) and torch.equal(vc[3, 0], v[2])
    changed = (pool != before).reshape(4, 2, 2, 4, -1).any(-1)
    assert changed.sum() == 4 and not changed[:, 1].any()


def test_rms_norms():
    x, r, w = torch.randn(5, 64).half(), torch.randn(5, 64).half(), torch.randn(64).half()
    out = rms_norm_ref(x, w, 1e-6)
    xf = x.double()
    ref = xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)
    out2, res = fused_add_rms_norm_ref(x, r, w, 1e-6)
    torch.testing.assert_close(res, x + r)
    torch.testing.assert_close(out2, rms_norm_ref(x + r, w, 1e-6))


def test_silu_and_mul_ref():
    x = torch.randn(3, 10)
    torch.testing.assert_close(silu_and_mul_ref(x), torch.nn.functional.silu(x[:, :5]) * x[:, 5:])


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_rope_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    d, theta = 32, 500000.0
    kw = {"rope_scaling": dict(scaling, rope_theta=theta)} if scaling else {"rope_theta": theta}
    cfg = LlamaConfig(hidden_size=d * 4, num_attention_heads=4, num_key_value_heads=2, head_dim=d,
                      max_position_embeddings=4096, **kw)
    emb = LlamaRotaryEmbedding(cfg)
    pos = torch.tensor([0, 1, 7, 100, 3000, 4095])
    q, k = torch.randn(6, 4, d), torch.randn(6, 2, d)
    cos, sin = emb(q, pos[None])
    qr, kr = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    cache = build_cos_sin_cache(d, 4096, theta, scaling, "cpu")
    half = d // 2
    torch.testing.assert_close(cache[pos, :half], cos[0, :, :half], atol=1e-6, rtol=0)
    torch.testing.assert_close(cache[pos, half:], sin[0, :, :half], atol=1e-6, rtol=0)
    q2, k2 = apply_rope_ref(q.clone(), k.clone(), pos, cache)
    torch.testing.assert_close(q2, qr[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k2, kr[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def complex_rope(x, positions, inv_freq):
    """Llama 4's rotation, written as its reference writes it: x as complex numbers
    ``x[2i] + 1j * x[2i + 1]`` times ``e^(1j * p * f_i)``, in float32, cast back to x's dtype."""
    angles = torch.outer(positions.to(torch.float32), inv_freq)
    rot = torch.polar(torch.ones_like(angles), angles)[:, None]  # [N, 1, D/2]
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * rot).flatten(-2).to(x.dtype)


SCOUT_ROPE = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
              "original_max_position_embeddings": 8192}  # Llama 4 Scout's: no smoothing band


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [None, SCOUT_ROPE])
def test_interleaved_rope_is_the_complex_rotation(dtype, scaling):
    """``interleaved=True`` rotates the pairs (2i, 2i + 1) by the cache's angle i: Llama 4's
    complex-number rotation, from the same cos/sin cache as the rotate_half form."""
    from engine.kernels.rope import rope_inv_freq

    d, theta = 32, 500000.0
    cache = build_cos_sin_cache(d, 40000, theta, scaling, "cpu")
    inv = rope_inv_freq(d, theta, scaling)
    pos = torch.tensor([0, 1, 7, 100, 8191, 8192, 39999])
    q, k = torch.randn(7, 4, d).to(dtype), torch.randn(7, 2, d).to(dtype)
    q2, k2 = apply_rope_ref(q.clone(), k.clone(), pos, cache, interleaved=True)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(q2, complex_rope(q, pos, inv), **tol)
    torch.testing.assert_close(k2, complex_rope(k, pos, inv), **tol)
    # and it is the rotate_half rotation of the de-interleaved vector
    perm = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    q3, _ = apply_rope_ref(q[..., perm].clone(), k[..., perm].clone(), pos, cache)
    torch.testing.assert_close(q2[..., perm], q3, atol=0, rtol=0)


def test_interleaved_rope_at_llama_4_scouts_own_shape_matches_transformers():
    """Llama 4 Scout's rope (head_dim 128, theta 500000, llama3 scaling with low and high
    frequency factors both 1, i.e. no smoothing band) as transformers' Llama 4 applies it."""
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextRotaryEmbedding, apply_rotary_emb

    d, theta = 128, 500000.0
    cfg = Llama4TextConfig(hidden_size=5120, num_attention_heads=40, num_key_value_heads=8, head_dim=d,
                           max_position_embeddings=65536, rope_scaling=dict(SCOUT_ROPE, rope_theta=theta))
    emb = Llama4TextRotaryEmbedding(cfg)
    pos = torch.tensor([0, 1, 8191, 8192, 20000, 65535])
    freqs_cis = emb(torch.zeros(1), pos[None])  # [1, N, D/2] complex
    q, k = torch.randn(6, 40, d), torch.randn(6, 8, d)
    qr, kr = apply_rotary_emb(q[None], k[None], freqs_cis)
    cache = build_cos_sin_cache(d, 65536, theta, SCOUT_ROPE, "cpu")
    q2, k2 = apply_rope_ref(q.clone(), k.clone(), pos, cache, interleaved=True)
    torch.testing.assert_close(q2, qr[0], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(k2, kr[0], atol=1e-4, rtol=1e-5)


def test_rope_bad_scaling():
    with pytest.raises(KernelError):
        build_cos_sin_cache(8, 4, 1e4, {"rope_type": "yarn", "factor": 2.0}, "cpu")
    with pytest.raises(KernelError):
        build_cos_sin_cache(8, 4, 1e4, {"rope_type": "llama3", "factor": 2.0}, "cpu")
    with pytest.raises(KernelError):  # high below low: no wavelength band is defined
        build_cos_sin_cache(8, 4, 1e4, dict(SCOUT_ROPE, high_freq_factor=0.5), "cpu")


def _params(b, t=1.0, k=0, p=1.0, mp=0.0):
    return (torch.full((b,), t), torch.full((b,), k, dtype=torch.int32), torch.full((b,), p),
            torch.full((b,), mp))


def test_noise_is_known_and_uniform():
    u = noise_uniform(torch.tensor([0, -1, 2**40 + 3]), torch.tensor([0, 5, 9]), 4096)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.02
    assert not torch.equal(u[0], u[1])
    # the hash is part of the contract: check it against plain Python integers
    for seed, step in ((1234, 7), (-5, 2**33 + 1), (2**62 + 17, 0)):
        got = noise_uniform(torch.tensor([seed]), torch.tensor([step]), 5)[0].tolist()
        assert got == [py_noise(seed, step, v) for v in range(5)]


def py_mix(x):
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def py_noise(seed, step, v):
    s = seed & 0xFFFFFFFFFFFFFFFF
    h = py_mix((s & 0xFFFFFFFF) ^ 0x9E3779B9)
    h = py_mix(h ^ (s >> 32))
    h = py_mix(h ^ (step & 0xFFFFFFFF))
    h = py_mix(h ^ v)
    return ((h >> 9) + 0.5) / 2**23


def test_sample_greedy_and_seeded():
    logits = torch.randn(4, 50)
    t, k, p, mp = _params(4, t=0.0)
    ids = sample_ref(logits, t, k, p, mp, torch.arange(4), torch.zeros(4, dtype=torch.int64))
    assert torch.equal(ids, logits.argmax(-1))
    t, k, p, mp = _params(4, t=0.8)
    seeds, steps = torch.tensor([1, 2, 1, 3]), torch.tensor([0, 0, 0, 4])
    rows = logits.clone()
    rows[2] = rows[0]
    a = sample_ref(rows, t, k, p, mp, seeds, steps)
    assert a[0] == a[2]  # same seed, step and logits -> same token, whatever the batch
    b = sample_ref(rows[[3, 0]], t[:2], k[:2], p[:2], mp[:2], seeds[[3, 0]], steps[[3, 0]])
    assert b[0] == a[3] and b[1] == a[0]


def test_sample_distribution_and_filters():
    v, n = 6, 6000
    logits = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.04, 0.01]))[None].expand(n, v)
    seeds, steps = torch.arange(n), torch.full((n,), 3)
    ids = sample_ref(logits, *_params(n), seeds, steps)
    freq = torch.bincount(ids, minlength=v).float() / n
    torch.testing.assert_close(freq, logits[0].exp(), atol=0.025, rtol=0)
    assert set(sample_ref(logits, *_params(n, k=2), seeds, steps).tolist()) == {0, 1}
    assert set(sample_ref(logits, *_params(n, p=0.75), seeds, steps).tolist()) == {0, 1, 2}  # 0.7 < 0.75
    assert set(sample_ref(logits, *_params(n, p=0.7), seeds, steps).tolist()) == {0, 1}
    assert set(sample_ref(logits, *_params(n, mp=0.3), seeds, steps).tolist()) == {0, 1, 2}  # 0.15/0.4
    got = sample_ref(logits, *_params(n, k=3, p=0.8), seeds, steps)  # top-p renormalised after top-k
    assert set(got.tolist()) == {0, 1}


def test_dispatch_env(monkeypatch):
    from engine.kernels import _dispatch, backend_for, rms_norm

    x = torch.randn(2, 8)
    monkeypatch.setenv("INFIRE_KERNELS", "torch")
    monkeypatch.setattr(_dispatch, "_forced", None)
    assert backend_for(x) == "torch"
    monkeypatch.setenv("INFIRE_KERNELS", "triton")
    assert backend_for(x) == "torch"  # read once: the first call's choice holds
    monkeypatch.delenv("INFIRE_KERNELS")
    monkeypatch.setattr(_dispatch, "_forced", None)
    assert backend_for(x) == "torch"  # CPU tensors always take the reference by default
    torch.testing.assert_close(rms_norm(x, torch.ones(8), 1e-6), rms_norm_ref(x, torch.ones(8), 1e-6))
    monkeypatch.setenv("INFIRE_KERNELS", "cuda-please")
    monkeypatch.setattr(_dispatch, "_forced", None)
    with pytest.raises(KernelError):
        backend_for(x)
    with pytest.raises(KernelError):  # a bad value is not kept: every call says so
        backend_for(x)
    with pytest.raises(KernelError):
        rms_norm(x, torch.ones(7), 1e-6)


def test_rope_at_llama_3_1s_own_shape_and_context_matches_transformers():
    """Llama 3.1's rope (head_dim 128, theta 500000, llama3 scaling: factor 8 from 8,192) at
    positions up to its 131,072: the cache's cos/sin as transformers computes them, deep in the
    context where a wrong wavelength band would show."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    d, theta, ctx = 128, 500000.0, 131072
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=d,
                      max_position_embeddings=ctx, rope_scaling=dict(scaling, rope_theta=theta))
    emb = LlamaRotaryEmbedding(cfg)
    pos = torch.tensor([0, 8191, 8192, 32768, 65537, 100000, 120000, ctx - 1])
    cos, sin = emb(torch.zeros(1, 1, d), pos[None])
    cache = build_cos_sin_cache(d, ctx, theta, scaling, "cpu")
    half = d // 2
    # float32 angles of ~1e5 radians: both sides compute them alike (seen: equal); the cache
    # without the scaling is ~2 off there
    torch.testing.assert_close(cache[pos, :half], cos[0, :, :half], atol=1e-5, rtol=0)
    torch.testing.assert_close(cache[pos, half:], sin[0, :, :half], atol=1e-5, rtol=0)
    unscaled = build_cos_sin_cache(d, ctx, theta, None, "cpu")
    assert (unscaled[pos, :half] - cos[0, :, :half]).abs().max() > 0.5

"""Triton kernels under TRITON_INTERPRET=1 on CPU against the torch references (small sizes,
float32 and float16; bf16 only on the GPU, where tests/gpu/test_kernels.py covers real sizes).

Outputs are poisoned with NaN (or -7 for ids) before each run so an unwritten element fails.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if torch.cuda.is_available():  # pragma: no cover - on a GPU the compiled kernels are tested in tests/gpu
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
pytest.importorskip("triton")
# Triton reads the switch when a @triton.jit module is first imported: on for the imports below,
# then back as it was (the fixture below turns it on again while this module's tests run).
_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"

from engine.kernels import _dispatch, activation, attention, kv_write, norm, rope  # noqa: E402
from engine.kernels.sample import filter_ref, sample as sample_api, sample_ref  # noqa: E402
from engine.kernels.activation_triton import silu_and_mul_triton  # noqa: E402
from engine.kernels.attention_triton import (decode_splits, long_keys, packed_exp, paged_attention_triton,  # noqa: E402
                                             prefill_shape)
from engine.kernels.kv_write_triton import write_kv_triton  # noqa: E402
from engine.kernels.norm_triton import rms_norm_triton  # noqa: E402
from engine.kernels.rope_triton import apply_rope_triton  # noqa: E402
from engine.kernels.sample_triton import sample_triton  # noqa: E402
from tests.unit.test_kernels_ref import build_batch, make_pool  # noqa: E402

if _INTERPRET is None:
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _INTERPRET


@pytest.fixture(autouse=True, scope="module")
def _triton_interpreted():
    """TRITON_INTERPRET=1 while this module's tests run; restored after."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield

DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    assert not torch.isnan(out).any(), "NaN in output (unwritten element?)"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [1, 16])
def test_write_kv(dtype, block):
    pool, kc, vc = make_pool(6, 3, block, 2, 8, dtype, layer=2)
    pool.fill_(float("nan"))
    ref_pool = pool.clone()
    n = 5
    k, v = torch.randn(n, 2, 8).to(dtype), torch.randn(n, 2, 8).to(dtype)
    slots = torch.randperm(6 * block)[:n]
    slots[1] = -1
    write_kv_triton(k, v, kc, vc, slots)
    kv_write.write_kv_ref(k, v, ref_pool[:, 2, 0], ref_pool[:, 2, 1], slots)
    assert torch.equal(pool.isnan(), ref_pool.isnan())
    assert torch.equal(pool.nan_to_num(0), ref_pool.nan_to_num(0))


def _prefill_error(dtype, block, hq, hkv, d, q_lens, seq_lens, seed, chunk=0, num_splits=None, poison=False):
    """The relative error of the kernel against the reference on a random batch of ``q_lens``
    queries over ``seq_lens`` contexts in shuffled pages (a NaN-poisoned output). ``poison``
    (with ``chunk``): after the reference ran, the K/V of each sequence's positions before its
    first new token's chunk (rounded down to 64, a whole key tile of every launch shape here)
    become NaN: a kernel that loads them writes NaN, even where it masks their scores (the
    probability 0 meets the NaN value in the PV dot)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    pages = sum((s + block - 1) // block for s in seq_lens) + 2
    _, kc, vc = make_pool(pages, 2, block, hkv, d, dtype)
    tables, _, qsl, sl = build_batch(q_lens, seq_lens, block, pages, gen)
    q = torch.randn(sum(q_lens), hq, d).to(dtype)
    ref = attention.paged_attention_ref(q, kc, vc, qsl, sl, tables, 1 / math.sqrt(d), chunk=chunk)
    if poison:
        for b, (ql, sl_b) in enumerate(zip(q_lens, seq_lens)):
            first = sl_b - ql
            for pos in range((first - first % chunk) // 64 * 64):
                kc[tables[b, pos // block], pos % block] = float("nan")
                vc[tables[b, pos // block], pos % block] = float("nan")
    out = torch.full_like(q, float("nan"))
    paged_attention_triton(q, kc, vc, qsl, sl, tables, 1 / math.sqrt(d), max(q_lens), max(seq_lens), out=out,
                           chunk=chunk, num_splits=num_splits)
    return rel_err(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [1, 16])
@pytest.mark.parametrize("lens", [([7, 1, 4, 1, 2], [7, 33, 20, 1, 18]),
                                  # query tiles of BLOCK_M // 3 tokens (10 in float32, 42 in float16):
                                  # sequences over several tiles, one on a tile boundary, and an empty
                                  # query among them
                                  ([45, 1, 0, 21, 1, 22, 1], [45, 40, 9, 50, 3, 22, 70])])
def test_paged_attention_prefill_and_mixed(dtype, block, lens):
    # GQA group of 3 (not a power of two); prefill, decode, chunked prefill, ...
    assert _prefill_error(dtype, block, 6, 2, 16, *lens, seed=block) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,lens", [(32, ([300, 130, 1, 77], [300, 400, 90, 333])),
                                    (24, ([300, 130, 1, 77], [300, 400, 90, 333])),
                                    # head_dim 128 in 16 bits: 256-row tiles for a big step, 64-row
                                    # tiles for a few chunks (prefill_shape; 4 "SMs" here)
                                    (128, ([300, 130, 1, 77], [300, 400, 90, 333])),
                                    (128, ([20, 1, 9], [150, 30, 9]))])
def test_a_long_prefill_reads_its_unmasked_tiles_and_its_band_alike(dtype, d, lens):
    """Long prompts and chunks deep in a context: most K/V tiles lie before every row of a query
    tile and take the unmasked path, the diagonal band and the ragged end the masked one; a head
    dim that is not a power of two masks every tile. Each query tile must see exactly the keys
    at or before each of its rows, whichever path read them, in whichever order the tiles ran."""
    assert _prefill_error(dtype, 16, 8, 2, d, *lens, seed=d) < TOL[dtype]  # prompt, deep chunk, decode, chunk


# Chunked local attention over mixed steps: a prompt over several chunks, decode rows on, just
# past and deep into chunks, a chunk of a prompt over cached context that starts mid-chunk and
# one that crosses into the next chunk, an empty query.
CHUNKED_LENS = ([150, 1, 1, 60, 0, 1, 45, 1], [150, 200, 64, 130, 9, 65, 300, 101])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [16, 24])
# key tiles of 32 (float32) and 64 (float16) positions: chunks of a whole number of tiles, of
# none, and shorter than a query tile (10 tokens in float32, 42 in float16: tiles straddle)
@pytest.mark.parametrize("chunk", [7, 32, 40, 64, 100])
def test_chunked_attention_matches_the_reference(dtype, d, chunk):
    """Chunked local attention in both kernels: each token sees its own chunk up to itself, the
    prefill rows through the lower-bound-masked, unmasked and band tiles, the decode rows split
    three ways over their chunk (the reduce partitions it as the decode kernel did); head_dim 24
    masks every tile. GQA group of 3, 16-token pages."""
    assert _prefill_error(dtype, 16, 6, 2, d, *CHUNKED_LENS, seed=chunk, chunk=chunk, num_splits=3) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [32, 100])
def test_chunked_attention_on_one_token_pages(dtype, chunk):
    """Block size 1: every key position its own page, chunk boundaries anywhere in a tile."""
    assert _prefill_error(dtype, 1, 4, 2, 32, *CHUNKED_LENS, seed=1, chunk=chunk) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [64, 100, 128])
def test_chunked_attention_reads_no_key_before_a_rows_chunk(dtype, chunk):
    """The point of chunked attention: a row reads nothing before its chunk (a 32k prompt in 8k
    chunks scores a quarter of the pairs causal attention scores). The positions before each
    sequence's first new token's chunk are NaN in the cache: a kernel that loads any of them,
    masked score or not, writes NaN."""
    lens = ([200, 1, 1, 90, 1], [450, 300, 129, 220, 1000])
    assert _prefill_error(dtype, 16, 4, 2, 32, *lens, seed=5, chunk=chunk, poison=True) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_query_tile_across_a_chunk_boundary_has_no_nan(dtype):
    """One KV head (a query tile is 32 tokens in float32, 128 in float16): a tile whose later rows
    begin a new chunk sees, for those rows, no key in its first key tiles; their running max
    stays -inf there, and exp2(-inf - -inf) must not reach the output."""
    torch.manual_seed(6)
    gen = torch.Generator().manual_seed(6)
    block, hq, hkv, d = 16, 2, 2, 16
    q_lens, seq_lens = [300, 50], [300, 170]
    pages = sum(-(-s // block) for s in seq_lens) + 2
    _, kc, vc = make_pool(pages, 1, block, hkv, d, dtype, layer=0)
    tables, _, qsl, sl = build_batch(q_lens, seq_lens, block, pages, gen)
    q = torch.randn(sum(q_lens), hq, d).to(dtype)
    for chunk in (40, 100):  # float32 tile 1 (tokens 32-63) straddles 40; float16 tile 0 straddles 100
        out = torch.full_like(q, float("nan"))
        paged_attention_triton(q, kc, vc, qsl, sl, tables, 0.25, 300, 300, out=out, chunk=chunk)
        assert not out.isnan().any(), chunk
        ref = attention.paged_attention_ref(q, kc, vc, qsl, sl, tables, 0.25, chunk=chunk)
        assert rel_err(out, ref) < TOL[dtype], chunk


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunk_zero_and_a_chunk_longer_than_every_context_are_causal_attention(dtype):
    """chunk=0 is the causal path as it was; a chunk no shorter than every context runs the
    chunked kernels over the same tiles in the same order, so it gives the very same bits."""
    torch.manual_seed(7)
    gen = torch.Generator().manual_seed(7)
    block, hq, hkv, d = 16, 6, 2, 16
    q_lens, seq_lens = [45, 1, 21, 1], [45, 40, 50, 70]
    pages = sum(-(-s // block) for s in seq_lens) + 2
    _, kc, vc = make_pool(pages, 1, block, hkv, d, dtype, layer=0)
    tables, _, qsl, sl = build_batch(q_lens, seq_lens, block, pages, gen)
    q = torch.randn(sum(q_lens), hq, d).to(dtype)
    causal = paged_attention_triton(q, kc, vc, qsl, sl, tables, 0.25, 45, 70, num_splits=3)
    assert torch.equal(paged_attention_triton(q, kc, vc, qsl, sl, tables, 0.25, 45, 70, num_splits=3, chunk=0), causal)
    assert torch.equal(paged_attention_triton(q, kc, vc, qsl, sl, tables, 0.25, 45, 70, num_splits=3, chunk=70),
                       causal)
    ref = attention.paged_attention_ref(q, kc, vc, qsl, sl, tables, 0.25)
    assert rel_err(causal, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [64, 100])
def test_chunked_decode_rows_split_their_chunk_whatever_the_bound(dtype, chunk):
    """Decode rows only, a graph's bound of 131,072: each row's chunk, however short (a row on
    the first position of a chunk sees one key), is cut into the split count's partitions by
    the decode kernel and the reduce alike, with more splits than the chunk has tiles too."""
    torch.manual_seed(8)
    gen = torch.Generator().manual_seed(8)
    block, hq, hkv, d = 16, 4, 1, 32
    seq_lens = [3000, 20, 1, 700, 128, 129, 201]
    pages = sum(-(-s // block) for s in seq_lens) + 2
    _, kc, vc = make_pool(pages, 1, block, hkv, d, dtype, layer=0)
    tables, _, qsl, sl = build_batch([1] * len(seq_lens), seq_lens, block, pages, gen)
    q = torch.randn(len(seq_lens), hq, d).to(dtype)
    ref = attention.paged_attention_ref(q, kc, vc, qsl, sl, tables, 0.2, chunk=chunk)
    for splits in (None, 2, 5, 64):
        out = torch.full_like(q, float("nan"))
        paged_attention_triton(q, kc, vc, qsl, sl, tables, 0.2, 1, 131072, num_splits=splits, out=out, chunk=chunk)
        assert rel_err(out, ref) < TOL[dtype], splits


def test_the_prefill_shape_fills_the_gpu_before_it_grows_its_tiles():
    """Head_dim 128 in 16 bits: 256-row tiles (the fastest per FLOP) while their programs fill
    the SMs, over 128 keys with packed probabilities where that was measured (a 16-bit cache,
    no chunks), 64 keys otherwise; 64-row tiles for a step of a few hundred tokens (a deep
    chunk's few long programs would leave SMs idle); other head dims and float32 keep their one
    shape. It depends on the token count, the cache and the device alone (a mixed graph's
    bucket fixes it)."""
    assert prefill_shape(4096, 4, 8, False, 128, 132, True) == (256, 128, 8, 2)
    assert prefill_shape(4096, 4, 8, False, 128, 132, False) == (256, 64, 8, 3)  # e4m3 cache, chunks
    assert prefill_shape(13 * 64, 4, 8, False, 128, 132, True)[0] == 256  # 104 programs: 3/4 of 132 SMs
    assert prefill_shape(12 * 64, 4, 8, False, 128, 132, True) == (64, 64, 4, 3)  # 96
    assert prefill_shape(460, 4, 8, False, 128, 132, True) == (64, 64, 4, 3)
    assert prefill_shape(4096, 4, 8, True, 128, 132, True)[0] == 32
    assert prefill_shape(4096, 3, 3, False, 64, 132, True) == (128, 64, 4, 3)
    assert packed_exp(256, 128, torch.bfloat16, (9, 0)) and packed_exp(256, 128, torch.float16, (9, 0))
    assert not packed_exp(256, 64, torch.bfloat16, (9, 0)) and not packed_exp(64, 64, torch.bfloat16, (9, 0))
    assert not packed_exp(256, 128, torch.float32, (9, 0))
    # 128 keys on a 16-bit, unchunked cache from sm_90 (and interpreted), not before
    assert long_keys((9, 0), False, 0) and long_keys(None, False, 0) and long_keys((10, 0), False, 0)
    assert not long_keys((8, 0), False, 0) and not long_keys((8, 9), False, 0)
    assert not long_keys((9, 0), True, 0) and not long_keys((9, 0), False, 8192)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_paged_attention_decode(dtype, splits):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    block, hq, hkv, d = 16, 8, 2, 32
    seq_lens = [1, 16, 17, 150, 64]
    q_lens = [1] * len(seq_lens)
    pages = sum((s + block - 1) // block for s in seq_lens) + 2
    _, kc, vc = make_pool(pages, 1, block, hkv, d, dtype, layer=0)
    tables, _, qsl, sl = build_batch(q_lens, seq_lens, block, pages, gen)
    q = torch.randn(len(seq_lens), hq, d).to(dtype)
    out = torch.full_like(q, float("nan"))
    # max_seq_len above the true max (as a CUDA graph captured for longer contexts would pass)
    paged_attention_triton(q, kc, vc, qsl, sl, tables, 0.2, 1, 200, num_splits=splits, out=out)
    ref = attention.paged_attention_ref(q, kc, vc, qsl, sl, tables, 0.2)
    assert rel_err(out, ref) < TOL[dtype]


def test_decode_split_heuristic():
    assert decode_splits(1, 8, 8192, 64, 132) > 8  # batch 1: spread the context over the chip
    assert decode_splits(256, 8, 2048, 64, 132) == 1  # big batch: one pass, no reduce
    assert decode_splits(1, 8, 100, 64, 132) == 2  # never more splits than KV tiles
    assert decode_splits(3, 2, 131072, 64, 4) == 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_of_every_length_are_exact_whatever_the_bound_and_the_split_count(dtype):
    """The splits partition each row's own context, not the bound (a graph's 131,072 would give
    a 3,000-token row one program of 64k positions): a long row beside short ones, one-token
    and one-tile rows, and more splits than a row has tiles all merge exactly."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(2)
    block, hq, hkv, d = 16, 4, 1, 32
    seq_lens = [3000, 20, 1, 700]
    pages = sum((s + block - 1) // block for s in seq_lens) + 2
    _, kc, vc = make_pool(pages, 1, block, hkv, d, dtype, layer=0)
    tables, _, qsl, sl = build_batch([1] * 4, seq_lens, block, pages, gen)
    q = torch.randn(4, hq, d).to(dtype)
    ref = attention.paged_attention_ref(q, kc, vc, qsl, sl, tables, 0.2)
    for splits in (None, 5, 64):
        out = torch.full_like(q, float("nan"))
        paged_attention_triton(q, kc, vc, qsl, sl, tables, 0.2, 1, 131072, num_splits=splits, out=out)
        assert rel_err(out, ref) < TOL[dtype], splits


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm(dtype, residual):
    x, w = torch.randn(5, 72).to(dtype), torch.randn(72).to(dtype)
    r = torch.randn(5, 72).to(dtype) if residual else None
    out, res_out = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    rms_norm_triton(x, r, w, 1e-5, out=out, res_out=res_out)
    if residual:
        ref, ref_res = norm.fused_add_rms_norm_ref(x, r, w, 1e-5)
        torch.testing.assert_close(res_out, ref_res, atol=0, rtol=0)
    else:
        ref = norm.rms_norm_ref(x, w, 1e-5)
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = (torch.randn(3, 2 * 100) * 3).to(dtype)
    out = torch.full((3, 100), float("nan"), dtype=dtype)
    silu_and_mul_triton(x, out=out)
    torch.testing.assert_close(out, activation.silu_and_mul_ref(x), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [16, 24])
def test_interleaved_rope_in_place_on_strided_views(dtype, d):
    """Llama 4's pairs (2i, 2i + 1): the kernel rotates q and k, views of a fused qkv projection
    (row stride q + 2 kv), as the complex-number rotation does, and leaves v alone; head_dim 24
    masks half of its 16 columns of pairs."""
    from tests.unit.test_kernels_ref import SCOUT_ROPE, complex_rope

    scaling = dict(SCOUT_ROPE, original_max_position_embeddings=32)
    cache = rope.build_cos_sin_cache(d, 128, 5e5, scaling, "cpu")
    inv = rope.rope_inv_freq(d, 5e5, scaling)
    qkv = torch.randn(5, (6 + 2 + 2) * d).to(dtype)
    q, k = qkv[:, :6 * d].view(5, 6, d), qkv[:, 6 * d:8 * d].view(5, 2, d)
    v_before = qkv[:, 8 * d:].clone()
    pos = torch.tensor([0, 1, 31, 64, 127])
    q_ref, k_ref = complex_rope(q, pos, inv), complex_rope(k, pos, inv)
    q_ref2, k_ref2 = rope.apply_rope_ref(q.clone(), k.clone(), pos, cache, interleaved=True)
    apply_rope_triton(q, k, pos, cache, interleaved=True)
    torch.testing.assert_close(q, q_ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(k, k_ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(q, q_ref2, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(k, k_ref2, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(qkv[:, 8 * d:], v_before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_on_strided_views(dtype):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    cache = rope.build_cos_sin_cache(16, 128, 5e5, scaling, "cpu")
    qkv = torch.randn(5, (6 + 2 + 2) * 16).to(dtype)  # q, k, v of a fused projection
    q, k = qkv[:, :96].view(5, 6, 16), qkv[:, 96:128].view(5, 2, 16)
    v_before = qkv[:, 128:].clone()
    q_ref, k_ref = q.clone(), k.clone()
    pos = torch.tensor([0, 1, 31, 64, 127])
    apply_rope_triton(q, k, pos, cache)
    rope.apply_rope_ref(q_ref, k_ref, pos, cache)
    torch.testing.assert_close(q, q_ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(k, k_ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(qkv[:, 128:], v_before)


def _sample_case(b, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    # per-row spread: peaked rows keep a few tokens, flat ones keep hundreds (sharp filter tests)
    logits = torch.randn(b, vocab, generator=g) * (torch.rand(b, 1, generator=g) * 3.5 + 0.5)
    temp = torch.rand(b, generator=g) * 1.5 + 0.2
    temp[::5] = 0.0
    top_k = torch.randint(0, 40, (b,), generator=g, dtype=torch.int32)
    top_k[::3] = 0
    top_p = torch.where(torch.rand(b, generator=g) < 0.5, torch.rand(b, generator=g), torch.ones(b))
    min_p = torch.where(torch.rand(b, generator=g) < 0.3, torch.rand(b, generator=g) * 0.2, torch.zeros(b))
    seeds = torch.randint(-2**62, 2**62, (b,), generator=g)
    steps = torch.randint(0, 1000, (b,), generator=g)
    return logits, temp, top_k, top_p, min_p, seeds, steps


@pytest.mark.parametrize("b,vocab,seed,cap", [(24, 700, 3, 1024), (10, 2500, 4, 4096), (24, 700, 5, 32)])
def test_sample_matches_reference(b, vocab, seed, cap):
    """cap 1024/4096: the candidate lists hold the thresholds; cap 32: most rows overflow their
    list and take the whole-row searches. The kept sets are compared, not only the draws."""
    args = _sample_case(b, vocab, seed)
    args[0][1, :] = 0.5  # a row of ties
    args[0][2, 17] = float("-inf")  # masked vocab entry
    out = torch.full((b,), -7, dtype=torch.int64)
    keep = torch.full((b, vocab), -1, dtype=torch.int8)
    sample_triton(*args, out=out, cap=cap, keep_out=keep)
    assert torch.equal(out, sample_ref(*args))
    sampled = args[1] > 0
    ref_keep, _ = filter_ref(*args[:5])
    assert torch.equal(keep[sampled].bool(), ref_keep[sampled]) and (keep[sampled] >= 0).all()


def test_top_p_threshold_below_candidate_floor():
    """top-p that keeps tokens with p < 2^-20: the candidate list cannot hold the threshold, so the
    whole-row search runs. Float32 sums cannot place a boundary that deep exactly (neither can
    the reference's cumsum), so: everything above the floor kept, and the count within a few."""
    vocab = 700
    logits = torch.linspace(0, -40, vocab)[None].repeat(2, 1)
    one, zero = torch.ones(2), torch.zeros(2)
    args = (logits, one, torch.zeros(2, dtype=torch.int32), torch.full((2,), 0.9999999), zero,
            torch.tensor([1, 2]), torch.tensor([0, 0]))
    keep = torch.full((2, vocab), -1, dtype=torch.int8)
    sample_triton(*args, keep_out=keep)
    ref_keep, p = filter_ref(*args[:5])
    assert keep[0].bool()[p[0] >= 2**-20].all()
    assert abs(int(keep[0].sum()) - int(ref_keep[0].sum())) <= 10
    assert int(keep[0].sum()) > int((p[0] >= 2**-20).sum())


def test_sample_is_batch_independent_and_respects_filters():
    logits, temp, top_k, top_p, min_p, seeds, steps = _sample_case(6, 300, 5)
    temp[:] = 1.0
    a = sample_triton(logits, temp, top_k, top_p, min_p, seeds, steps)
    order = torch.tensor([4, 0, 5])
    b = sample_triton(logits[order], temp[order], top_k[order], top_p[order], min_p[order], seeds[order],
                      steps[order])
    assert torch.equal(a[order], b)
    # many seeds of one row: the drawn set must be exactly the kept set (top_k=4, top_p on the rest)
    n = 64
    row = logits[:1].expand(n, -1).contiguous()
    ones = torch.ones(n)
    ids = sample_triton(row, ones, torch.full((n,), 4, dtype=torch.int32), ones, torch.zeros(n),
                        torch.arange(n), torch.zeros(n, dtype=torch.int64))
    assert set(ids.tolist()) <= set(torch.topk(logits[0], 4).indices.tolist())


def test_public_api_forced_triton(monkeypatch):
    monkeypatch.setenv("INFIRE_KERNELS", "triton")
    monkeypatch.setattr(_dispatch, "_forced", None)  # read again at the next kernel call
    x, w = torch.randn(3, 16), torch.randn(16)
    torch.testing.assert_close(norm.rms_norm(x, w, 1e-6), norm.rms_norm_ref(x, w, 1e-6))
    args = _sample_case(4, 64, 9)
    assert torch.equal(sample_api(*args), sample_ref(*args))


def _e4m3_batch(seed: int, q_lens: list[int], seq_lens: list[int], hq: int):
    """A batch over an e4m3 cache (2 KV heads, head_dim 16, 16-token pages; written by torch: the
    interpreter's narrowing is not trusted): float32 q, the caches, tables and metadata."""
    gen = torch.Generator().manual_seed(seed)
    block, hkv, d = 16, 2, 16
    pages = sum((s + block - 1) // block for s in seq_lens) + 2
    _, kc, vc = make_pool(pages, 2, block, hkv, d, torch.float32)
    tables, _, qsl, sl = build_batch(q_lens, seq_lens, block, pages, gen)
    q = torch.randn(sum(q_lens), hq, d)
    return q, kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn), tables, qsl, sl


@pytest.mark.parametrize("decode", [False, True])
def test_paged_attention_reads_an_fp8_cache(decode):
    """An e4m3 cache (kv_cache_dtype="fp8") is widened tile by tile: the kernels give what the
    reference gives over the same cache (the interpreter only widens e4m3 here, which it does
    exactly; its narrowing is not trusted, so the cache is written by torch)."""
    q_lens, seq_lens = ([1, 1, 1], [5, 40, 17]) if decode else ([7, 1, 12], [7, 33, 20])
    q, kc8, vc8, tables, qsl, sl = _e4m3_batch(3, q_lens, seq_lens, hq=6)
    out = torch.full_like(q, float("nan"))
    paged_attention_triton(q, kc8, vc8, qsl, sl, tables, 0.25, max(q_lens), max(seq_lens), out=out)
    ref = attention.paged_attention_ref(q, kc8, vc8, qsl, sl, tables, 0.25)
    assert rel_err(out, ref) < TOL[torch.float32]
    # and over the widened cache it is plain attention
    ref_wide = attention.paged_attention_ref(q, kc8.float(), vc8.float(), qsl, sl, tables, 0.25)
    assert torch.equal(ref, ref_wide)


@pytest.mark.parametrize("rows,cfg", [
    (1, {"block_n": 32, "block_k": 256, "split_k": 1}),
    (13, {"block_n": 16, "block_k": 32, "split_k": 3}),  # split K: float32 partials added atomically
    (40, {"block_m": 16, "block_n": 16, "block_k": 32, "split_k": 1}),  # three row tiles
])
def test_fp8_few_rows_gemm_matches_the_dequantized_matmul(rows, cfg):
    from engine.kernels import fp8
    from engine.kernels.fp8_triton import fp8_linear_small_m

    g = torch.Generator().manual_seed(rows)
    a = fp8.quantize_rows_ref(torch.randn(rows, 96, generator=g))  # e4m3 made by torch (see the fp8 tests)
    w_q, w_s = fp8.quantize_weight(torch.randn(48, 96, generator=g))
    bias = torch.randn(48, generator=g)
    out = fp8_linear_small_m(a, w_q, w_s, bias, torch.float32, {"num_warps": 4, "num_stages": 1, **cfg})
    ref = fp8.fp8_linear_ref(a, w_q, w_s, bias, torch.float32)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("decode", [False, True])
def test_bf16_queries_over_an_fp8_cache_run_float16_dots(decode):
    """bf16 q over an e4m3 cache: the kernels run the dots in float16 (e4m3 widens to it exactly;
    q is clamped to its range and rounded to float16, which keeps every bf16 mantissa bit), so
    they give the reference's float32 attention over the same q and cache to float16's rounding
    of the probabilities; a NaN in q stays a NaN (the clamp does not turn it into 65504)."""
    q_lens, seq_lens = ([1, 1, 1], [9, 40, 17]) if decode else ([5, 1, 12], [5, 33, 20])
    q, kc8, vc8, tables, qsl, sl = _e4m3_batch(5, q_lens, seq_lens, hq=4)
    q = q.to(torch.bfloat16)
    out = paged_attention_triton(q, kc8, vc8, qsl, sl, tables, 0.25, max(q_lens), max(seq_lens))
    ref = attention.paged_attention_ref(q.float(), kc8, vc8, qsl, sl, tables, 0.25)
    assert out.dtype == torch.bfloat16 and rel_err(out.float(), ref) < 1e-2
    q[0, 0, 0] = float("nan")
    out = paged_attention_triton(q, kc8, vc8, qsl, sl, tables, 0.25, max(q_lens), max(seq_lens))
    assert out[0, 0].float().isnan().all() and not out[0, 1:].float().isnan().any()  # that head only


@pytest.mark.parametrize("decode", [False, True])
def test_chunked_attention_over_an_fp8_cache(decode):
    """Chunked local attention over an e4m3 cache: the kernels give the reference's attention over
    the same cache (prompt and chunk rows across chunk boundaries, or decode rows in 3 splits)."""
    q_lens, seq_lens = ([1, 1, 1, 1], [5, 40, 17, 90]) if decode else ([47, 1, 30], [47, 33, 70])
    q, kc8, vc8, tables, qsl, sl = _e4m3_batch(9, q_lens, seq_lens, hq=6)
    for chunk in (16, 20):
        out = torch.full_like(q, float("nan"))
        paged_attention_triton(q, kc8, vc8, qsl, sl, tables, 0.25, max(q_lens), max(seq_lens), out=out,
                               num_splits=3, chunk=chunk)
        ref = attention.paged_attention_ref(q, kc8, vc8, qsl, sl, tables, 0.25, chunk=chunk)
        assert rel_err(out, ref) < TOL[torch.float32], chunk


def test_public_api_runs_chunked_attention_in_the_kernels(monkeypatch):
    """Through ``paged_attention`` with the Triton backend forced: the chunk reaches the kernels."""
    monkeypatch.setenv("INFIRE_KERNELS", "triton")
    monkeypatch.setattr(_dispatch, "_forced", None)
    q_lens, seq_lens = [30, 1], [50, 61]
    q, kc8, vc8, tables, qsl, sl = _e4m3_batch(10, q_lens, seq_lens, hq=4)
    kc, vc = kc8.float(), vc8.float()  # a float32 cache
    out = attention.paged_attention(q, kc, vc, qsl, sl, tables, 0.25, 30, 61, chunk=24)
    ref = attention.paged_attention_ref(q, kc, vc, qsl, sl, tables, 0.25, chunk=24)
    assert rel_err(out, ref) < TOL[torch.float32]
    assert rel_err(attention.paged_attention_ref(q, kc, vc, qsl, sl, tables, 0.25), ref) > 0.1


def _shared_batch(seed: int, dtype: torch.dtype, block: int = 4):
    """A mixed batch whose one-token rows fork from two prompts (as the prefix cache shares pages):
    rows 0-4 share 6 pages, rows 5-7 share 5 other pages (rows 5 and 6 a further 2), row 8 shares
    nothing, row 9 is a prefill chunk over the first prompt. Tables, lengths, q, caches."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, d = 6, 2, 16
    a, b = list(range(1, 7)), list(range(10, 15))
    fresh = iter(range(20, 200))
    rows = [a + [next(fresh) for _ in range(1 + i % 3)] for i in range(5)]
    rows += [b + [60, 61, next(fresh)], b + [60, 61, next(fresh), next(fresh)], b + [next(fresh)]]
    rows += [[next(fresh) for _ in range(8)], a + [next(fresh), next(fresh)]]
    seq_lens = [(len(p) - 1) * block + 1 + i % block for i, p in enumerate(rows)]
    q_lens = [1] * 9 + [5]
    tables = torch.zeros(len(rows), 12, dtype=torch.int32)
    for i, p in enumerate(rows):
        tables[i, :len(p)] = torch.tensor(p, dtype=torch.int32)
    _, kc, vc = make_pool(200, 1, block, hkv, d, dtype, layer=0)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    return tables, torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(q_lens), q, qsl, kc, vc


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("per_tile", [2, 16])
@pytest.mark.parametrize("long_rows", [False, True])
def test_cascade_attention_is_the_same_attention(dtype, splits, per_tile, long_rows):
    """With a cascade plan (engine/runner/cascade.py) the rows that share pages read them once a
    tile and merge that partial into their own: the output is the reference's, in one-split
    programs and through the reduce alike, whatever the tile height (2: groups over several
    tiles). The prefill row of the batch is untouched by the plan. ``long_rows``: the spare
    tiles split rows of a long context of their own (here 16 tokens is long), row 8 among them."""
    from engine.runner.cascade import LONG_ROW_TOKENS, max_tiles, plan_cascade

    torch.manual_seed(0)
    block = 4
    tables, sl, q_lens, q, qsl, kc, vc = _shared_batch(1, dtype, block)
    plan = plan_cascade(tables.numpy(), sl.numpy(), q_lens.numpy(), block, per_tile, max_tiles(len(sl), per_tile),
                        min_pages=2, long_row_tokens=16 if long_rows else LONG_ROW_TOKENS)
    kv_lo = plan.kv_lo
    assert kv_lo[9] == 0
    if per_tile == 2:  # rows 5-7 in one group would need two tiles: rows 5 and 6 alone save more
        assert plan.shared == 7 and kv_lo[5:7].tolist() == [7 * block, 7 * block]
    else:
        assert plan.shared == 8 and kv_lo[5:8].tolist() == [5 * block] * 3
    if long_rows:
        assert kv_lo[8] == (int(sl[8]) - 1) // block * block and plan.long == 1 + (per_tile == 2)
    else:
        assert kv_lo[8] == 0 and plan.long == 0
    cascade = (torch.from_numpy(plan.tiles), torch.from_numpy(kv_lo))
    ref = attention.paged_attention_ref(q, kc, vc, qsl, sl, tables, 0.3)
    out = torch.full_like(q, float("nan"))
    paged_attention_triton(q, kc, vc, qsl, sl, tables, 0.3, 5, 64, num_splits=splits, out=out, cascade=cascade)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [3, 5])
def test_planned_rows_with_long_tails_merge_every_partition(dtype, splits):
    """Rows of a group whose own tails (40-300 positions) span several of their partitions: the
    decode kernel and the reduce each cut the tail past ``kv_lo`` themselves and must agree (a
    reduce that partitioned the whole context instead dropped partials: 0.1 error)."""
    from engine.runner.cascade import max_tiles, plan_cascade

    gen = torch.Generator().manual_seed(splits)
    block, hq, hkv, d = 16, 4, 2, 16
    shared = list(range(1, 5))
    fresh = iter(range(10, 400))
    tails = [41, 76, 150, 300, 9, 120]
    rows = [shared + [next(fresh) for _ in range(-(-t // block))] for t in tails]
    seq_lens = [len(shared) * block + t for t in tails]
    tables = torch.zeros(len(rows), 30, dtype=torch.int32)
    for i, p in enumerate(rows):
        tables[i, :len(p)] = torch.tensor(p, dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    q_lens = torch.ones(len(rows), dtype=torch.int64)
    plan = plan_cascade(tables.numpy(), sl.numpy(), q_lens.numpy(), block, 16, max_tiles(len(rows), 16), min_pages=2)
    assert plan.shared == len(rows) and (plan.kv_lo == len(shared) * block).all()
    _, kc, vc = make_pool(400, 1, block, hkv, d, dtype, layer=0)
    q = torch.randn(len(rows), hq, d, generator=gen).to(dtype)
    qsl = torch.arange(len(rows) + 1, dtype=torch.int32)
    ref = attention.paged_attention_ref(q, kc, vc, qsl, sl, tables, 0.3)
    out = torch.full_like(q, float("nan"))
    paged_attention_triton(q, kc, vc, qsl, sl, tables, 0.3, 1, 1024, num_splits=splits, out=out,
                           cascade=(torch.from_numpy(plan.tiles), torch.from_numpy(plan.kv_lo)))
    assert rel_err(out, ref) < TOL[dtype]


def test_cascade_attention_over_an_fp8_cache():
    from engine.runner.cascade import max_tiles, plan_cascade

    tables, sl, q_lens, q, qsl, kc, vc = _shared_batch(2, torch.float32)
    kc8, vc8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    plan = plan_cascade(tables.numpy(), sl.numpy(), q_lens.numpy(), 4, 16, max_tiles(10, 16), min_pages=2,
                        long_row_tokens=16)
    assert plan.shared == 8 and plan.long == 1
    out = paged_attention_triton(q, kc8, vc8, qsl, sl, tables, 0.3, 5, 64,
                                 cascade=(torch.from_numpy(plan.tiles), torch.from_numpy(plan.kv_lo)))
    ref = attention.paged_attention_ref(q, kc8, vc8, qsl, sl, tables, 0.3)
    assert rel_err(out, ref) < TOL[torch.float32]

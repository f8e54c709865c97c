"""Triton paged attention.

The kernels share one page-gather scheme: a KV tile of BLOCK_N consecutive positions looks up
each position's page in the block table (``pos // block_size``) and reads that token's row at
``page * stride(0) + offset * stride(1) + kv_head * stride(2)``, so any block size (1, 16, ...)
and any page stride (a page of a multi-layer pool) work, and nothing is assumed contiguous but
head_dim. An e4m3 cache (``kv_cache_dtype="fp8"``) is widened tile by tile as it loads, to float16
(:func:`_dot_dtype_q`).

- ``_prefill_kernel`` (the queries longer than 1 of any step that has one): grid (Hkv, cdiv(N, TPT) + B), each
  program finding its (sequence, query tile) by a binary search over query_start_loc, a
  sequence's last tile first. A tile's BLOCK_M rows are (token, head-of-the-GQA-group) pairs, so
  the group's heads share each K/V tile read. Online softmax in base 2, causal mask from the
  absolute positions (chunked prefill and prefix hits: the first ``seq_len - q_len`` positions
  are cached context), applied only on the diagonal band (:func:`_prefill_tile`); the launch
  shape by :func:`prefill_shape`. Chunked local attention (``chunk`` > 0, ``CHUNKED``): a query
  tile's keys begin at its first row's chunk; the key tiles up to the first one inside every
  row's chunk take the mask with each row's lower bound, then come the unmasked tiles and the
  band as without chunks.
- ``_decode_kernel`` (every one-token query, in decode and mixed steps alike): flash-decoding. grid (B, Hkv, splits); each
  program reads one partition of the context once for all G heads of its KV head and writes a
  partial (normalised output, log2-sum-exp); ``_reduce_kernel`` merges the splits. The split count
  is a host int derived from B, Hkv, max_seq_len and the SM count, so the grid never depends on
  device data (CUDA-graph safe); each row cuts its own context into that many partitions
  (:func:`_partition`), so a long row beside short ones is read by all of its programs. The
  split count is a runtime argument, not a constexpr: a new max_seq_len must not cost a
  recompile in the middle of serving. Chunked local attention (``CHUNKED``): a row's context
  begins at its chunk, ``((seq_len - 1) // chunk) * chunk``, and the splits partition it from
  there (:func:`_row_lo`, shared with the reduce). ``chunk`` is a runtime int, not specialised,
  and ``CHUNKED`` a constexpr: an unchunked model's kernels compile to the instructions they had
  before chunks existed (one unused parameter more).
- ``_cascade_kernel`` (cascade attention; with a plan from engine/runner/cascade.py): one-token
  queries whose block tables begin with the same pages (a system prompt or a history served
  from the prefix cache) read those pages once per *tile* of rows instead of once per row.
  grid (tiles, Hkv, CASCADE_SPLITS): a tile lists up to R rows of one group and the group's shared
  length; its BLOCK_M query rows are (row, head-of-the-GQA-group) pairs attending to one
  partition of the shared prefix (no mask: every position of it precedes every row's token),
  and it writes each pair's partial (normalised output, log2-sum-exp; weight 0 when empty).
  The decode kernel then reads each row's context from ``kv_lo[b]`` (the shared length, 0
  outside a group) and merges the prefix partials where the output is made: at the end of a
  one-split program, or in the reduce (``CASC``, a constexpr: steps without a plan run the
  kernels without the merge).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.kernels._launch import CachedLauncher, pdl_entry
from engine.kernels.fp8_format import FP8
from engine.kernels.fp8_triton import f16_dot_operand

LOG2E = 1.4426950408889634


@triton.jit
def _table_pages(bt_ptr, b, s_bt, j, jm, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """The pages of sequence ``b``'s positions ``j`` (int64); ``MASKED``: positions outside ``jm``
    read page 0 (a tile known to lie inside the sequence reads its table unmasked)."""
    if MASKED:
        return tl.load(bt_ptr + b * s_bt + j // BLOCK_SIZE, mask=jm, other=0).to(tl.int64)
    else:
        return tl.load(bt_ptr + b * s_bt + j // BLOCK_SIZE).to(tl.int64)


@triton.jit
def _kv_tile_offsets(bt_ptr, b, s_bt, j, jm, kvh, s_p, s_b, s_h, BLOCK_SIZE: tl.constexpr):
    page = _table_pages(bt_ptr, b, s_bt, j, jm, BLOCK_SIZE, True)
    return page * s_p + (j % BLOCK_SIZE).to(tl.int64) * s_b + kvh * s_h


@triton.jit
def _dot_dtype_q(q, kc_ptr):
    """q in the dtype the dots run in: its own, or float16 for bf16 q over an e4m3 cache
    (:func:`engine.kernels.fp8_triton.f16_dot_operand`: with bf16 dots the e4m3 decode kernel
    spent its time converting and read 1.5 TB/s, slower than over a bf16 cache of twice the bytes)."""
    if kc_ptr.dtype.element_ty == tl.float8e4nv:
        q = f16_dot_operand(q)
    return q


@triton.jit
def _e4m3x4_to_f16(x):
    """Four e4m3 codes (one 32-bit register) to four float16, by the hardware's pair conversion."""
    return tl.inline_asm_elementwise(
        asm="{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        constraints="=r,=r,r", args=[x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _widen_v(v, q, ASM_V: tl.constexpr):
    """A V tile in q's dot dtype. Over an e4m3 cache (``ASM_V``, compiled kernels) the widening is
    inline assembly that is not pure, so it stays where it is written: a plain conversion is sunk
    by the compiler below the tile's shared-memory load into the dot's operand layout, where
    8-bit values cannot be transposed by ldmatrix (V is the dot's N-major operand) and were read
    a byte at a time — 64 single-byte shared loads a thread per tile (ops/gpu/aot_check.py counts
    them). Widened in registers, the tile goes to the dot as float16 through ldmatrix.trans."""
    if ASM_V:
        tl.static_assert(v.dtype == tl.float8e4nv and q.dtype == tl.float16, "ASM_V widens e4m3 for float16 dots")
        return _e4m3x4_to_f16(v)
    else:
        return v.to(q.dtype)


@triton.jit
def _attend_tile(q, m_i, l_i, acc, kc_ptr, vc_ptr, koff, voff, j, jm, qpos, d, dm, qk_scale,
                 CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr, ASM_V: tl.constexpr):
    """One K/V tile of online softmax in base 2: q's rows over the tile's positions ``j`` (those
    past the end masked by ``jm``; with ``CAUSAL``, those after a row's ``qpos`` too); the updated
    (running max, running sum, accumulator). The prefill and cascade kernels' loop body: inlined,
    it compiles to the instructions each kernel had written out (``ops/gpu/aot_check.py --ptx``
    before and after: the same sm_90 code for every spec)."""
    k = tl.load(kc_ptr + koff[None, :] + d[:, None], mask=jm[None, :] & dm[:, None], other=0.0).to(q.dtype)
    s = tl.dot(q, k, input_precision=DOT_PREC) * qk_scale
    if CAUSAL:
        s = tl.where(jm[None, :] & (j[None, :] <= qpos[:, None]), s, float("-inf"))
    else:
        s = tl.where(jm[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = _widen_v(tl.load(vc_ptr + voff[:, None] + d[None, :], mask=jm[:, None] & dm[None, :], other=0.0), q, ASM_V)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _exp2_packed(x, dt: tl.constexpr):
    """2**x for float32 ``x``, rounded to ``dt`` (bfloat16 or float16) first and computed two at
    a time by the special-function unit (``ex2.approx`` on a pair): half the SFU's instructions of
    ``tl.exp2``, and no float32 registers held for the probabilities, which go to the PV dot in
    ``dt`` anyway. The input's rounding costs about what rounding the output to ``dt`` costs
    (``|x| * 2**-8`` relative, and ``p`` is small where ``|x|`` is not)."""
    if dt == tl.bfloat16:
        return tl.inline_asm_elementwise(
            asm="{ .reg .b32 t; cvt.rn.bf16x2.f32 t, $2, $1; ex2.approx.ftz.bf16x2 $0, t; }",
            constraints="=r,r,r", args=[x], dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        tl.static_assert(dt == tl.float16, "packed exp2 in bfloat16 or float16")
        return tl.inline_asm_elementwise(
            asm="{ .reg .b32 t; cvt.rn.f16x2.f32 t, $2, $1; ex2.approx.f16x2 $0, t; }",
            constraints="=r,r,r", args=[x], dtype=tl.float16, is_pure=True, pack=2)


@triton.jit
def _load_tile(ptr, offs, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptr + offs, mask=mask, other=0.0)
    else:
        return tl.load(ptr + offs)


@triton.jit
def _prefill_tile(q, m_i, l_i, acc, kc_ptr, vc_ptr, bt_ptr, b, s_bt, j, kv_end, qpos, qlo, kvh,
                  s_kp, s_kb, s_kh, s_vp, s_vb, s_vh, d, dm, qk_scale,
                  BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, CHUNKED: tl.constexpr, DOT_PREC: tl.constexpr,
                  ASM_V: tl.constexpr, PACKED_EXP: tl.constexpr):
    """One K/V tile of the prefill kernel's online softmax (base 2). ``MASKED`` tiles are the
    diagonal band and the ragged end: positions past ``kv_end`` and after a row's ``qpos`` are
    masked out, with ``CHUNKED`` those before a row's ``qlo`` (its chunk's start) too. Unmasked
    tiles lie wholly before every row of the query tile (and in every row's chunk) and (head_dim
    a power of two) load and score without a mask or a select: most of a long prompt's tiles.
    ``PACKED_EXP``: the probabilities by :func:`_exp2_packed` (the large tiles, :func:`packed_exp`)."""
    jm = j < kv_end
    page = _table_pages(bt_ptr, b, s_bt, j, jm, BLOCK_SIZE, MASKED)  # one table read for K and V
    slot = (j % BLOCK_SIZE).to(tl.int64)
    koff = page * s_kp + slot * s_kb + kvh * s_kh
    voff = page * s_vp + slot * s_vb + kvh * s_vh
    k = _load_tile(kc_ptr, koff[None, :] + d[:, None], jm[None, :] & dm[:, None], MASKED).to(q.dtype)
    s = tl.dot(q, k, input_precision=DOT_PREC)
    if MASKED:
        seen = jm[None, :] & (j[None, :] <= qpos[:, None])
        if CHUNKED:
            seen = seen & (j[None, :] >= qlo[:, None])
        s = tl.where(seen, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if CHUNKED:
            # a row may have seen no key yet (its chunk begins past this tile, in a query tile that
            # straddles a chunk boundary): its max is still -inf, and exp2(-inf - -inf) is NaN.
            # Offset by 0 instead, so its p and alpha are 0; the max itself stays -inf.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_ref = m_new
        x = s - m_ref[:, None]
    else:
        # the scale folded into the exponent's operand: one multiply-add a score
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        m_ref = m_new
        x = s * qk_scale - m_new[:, None]
    alpha = tl.exp2(m_i - m_ref)
    v = _widen_v(_load_tile(vc_ptr, voff[:, None] + d[None, :], jm[:, None] & dm[None, :], MASKED), q, ASM_V)
    if PACKED_EXP:
        p = _exp2_packed(x, v.dtype)
        l_i = l_i * alpha + tl.sum(p.to(tl.float32), axis=1)
    else:
        p = tl.exp2(x)
        l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
    return m_new, l_i, acc


# Runtime ints that change with the batch are not specialised (==1, %16): a new block-table
# width or split count must never trigger a compile while serving.
@triton.jit(do_not_specialize=["s_bt", "NUM_SEQS", "chunk"])
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, out_ptr, qsl_ptr, sl_ptr, bt_ptr,
                    s_qn, s_qh, s_on, s_oh, s_kp, s_kb, s_kh, s_vp, s_vb, s_vh, s_bt, qk_scale, NUM_SEQS, chunk,
                    CHUNKED: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TPT: tl.constexpr,
                    DOT_PREC: tl.constexpr, MIN_Q: tl.constexpr, ASM_V: tl.constexpr, PACKED_EXP: tl.constexpr,
                    PDL: tl.constexpr):
    pdl_entry(PDL)
    # grid (Hkv, items): the KV heads of one item are neighbours in launch order. Work item i:
    # sequence b's items start at qsl[b] // TPT + b (a span of at least cdiv(q_len_b, TPT)), so b
    # is the last sequence whose start is <= i.
    kvh = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    lo = pid * 0
    hi = lo + NUM_SEQS - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = tl.load(qsl_ptr + mid) // TPT + mid <= pid
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    b = lo.to(tl.int64)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    # a sequence's last tile (the most keys) first: causal work grows with the tile, and the
    # longest programs starting first leave no long one alone at the end of the grid
    tile = (q_len + TPT - 1) // TPT - 1 - (pid - (q_start // TPT + lo))
    if (tile >= 0) & (q_len >= MIN_Q):
        seq_len = tl.load(sl_ptr + b)
        ctx = seq_len - q_len
        rows = tl.arange(0, BLOCK_M)
        t = tile * TPT + rows // G
        head = kvh * G + rows % G
        row_ok = (rows < TPT * G) & (t < q_len)
        qpos = ctx + t
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        tok = (q_start + t).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * s_qn + head[:, None] * s_qh + d[None, :],
                    mask=row_ok[:, None] & dm[None, :], other=0.0)
        q = _dot_dtype_q(q, kc_ptr)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        kv_end = tl.minimum(seq_len, ctx + tl.minimum(q_len, (tile + 1) * TPT))
        first = ctx + tile * TPT  # the tile's first query position (kv_end - 1 its last)
        # CHUNKED: a row sees its own chunk only, positions qlo ..= qpos. The tile's keys begin at
        # its first row's chunk start, rounded down to a key tile (kv_start); from `full`, the
        # first key tile at or after its last row's chunk start (so at or after every row's), up
        # to `band` they are every row's again. The tiles before `full` take the mask, with each
        # row's lower bound.
        qlo = qpos
        kv_start = 0
        full = 0
        if CHUNKED:
            qlo = (qpos // chunk) * chunk
            kv_start = ((first // chunk) * chunk // BLOCK_N) * BLOCK_N
            full = tl.cdiv(((kv_end - 1) // chunk) * chunk, BLOCK_N) * BLOCK_N
        # keys before the tile's first query position are every row's: no mask (a power-of-two
        # head_dim only; otherwise every tile masks its columns)
        band = kv_start
        if BLOCK_D == D:
            band = (first // BLOCK_N) * BLOCK_N
        if CHUNKED:
            full = tl.minimum(full, band)
            # not software-pipelined: it is at most one tile except in a query tile that straddles
            # a chunk boundary, and pipelined it cost the kernel registers (sm_90, 256-row tile,
            # G = 5: 408 bytes of spills against 248; the unchunked kernel's: 304)
            for start in tl.range(kv_start, full, BLOCK_N, num_stages=1):
                j = start + tl.arange(0, BLOCK_N)
                m_i, l_i, acc = _prefill_tile(q, m_i, l_i, acc, kc_ptr, vc_ptr, bt_ptr, b, s_bt, j, kv_end, qpos, qlo,
                                              kvh, s_kp, s_kb, s_kh, s_vp, s_vb, s_vh, d, dm, qk_scale,
                                              BLOCK_SIZE, True, CHUNKED, DOT_PREC, ASM_V, PACKED_EXP)
        for start in range(full, band, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = _prefill_tile(q, m_i, l_i, acc, kc_ptr, vc_ptr, bt_ptr, b, s_bt, j, kv_end, qpos, qlo, kvh,
                                          s_kp, s_kb, s_kh, s_vp, s_vb, s_vh, d, dm, qk_scale,
                                          BLOCK_SIZE, False, CHUNKED, DOT_PREC, ASM_V, PACKED_EXP)
        # unchunked, position `band` is visible to every row, so the running max is finite after
        # its tile; chunked, a row may see none of the first tiles (_prefill_tile guards that)
        for start in range(band, kv_end, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = _prefill_tile(q, m_i, l_i, acc, kc_ptr, vc_ptr, bt_ptr, b, s_bt, j, kv_end, qpos, qlo, kvh,
                                          s_kp, s_kb, s_kh, s_vp, s_vb, s_vh, d, dm, qk_scale,
                                          BLOCK_SIZE, True, CHUNKED, DOT_PREC, ASM_V, PACKED_EXP)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(out_ptr + tok[:, None] * s_on + head[:, None] * s_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dm[None, :])


_PREFILL_LAUNCH = CachedLauncher(_prefill_kernel, pdl=True)


@triton.jit
def _merge_prefix(o, lse, cpo_ptr, cplse_ptr, crow, rm, d, dm, D: tl.constexpr, CS: tl.constexpr):
    """Fold a row's CS cascade prefix partials into rows ``o`` (log2-sum-exp ``lse``) where ``rm``
    says the row has them; other rows come back unchanged (their weights are exp2(-inf) = 0)."""
    mx = lse
    for c in tl.static_range(CS):
        mx = tl.maximum(mx, tl.load(cplse_ptr + crow * CS + c, mask=rm, other=float("-inf")))
    w = tl.exp2(lse - mx)
    num = o * w[:, None]
    den = w
    for c in tl.static_range(CS):
        wc = tl.exp2(tl.load(cplse_ptr + crow * CS + c, mask=rm, other=float("-inf")) - mx)
        co = tl.load(cpo_ptr + (crow * CS + c)[:, None] * D + d[None, :], mask=rm[:, None] & dm[None, :], other=0.0)
        num += co * wc[:, None]
        den += wc
    return num / den[:, None]


@triton.jit
def _partition(length, NUM_SPLITS, BLOCK_N: tl.constexpr):
    """One split's share of a row's ``length`` positions: whole KV tiles, the row spread over
    every split of the grid (the decode kernel and the reduce agree on it)."""
    return tl.cdiv(tl.cdiv(length, BLOCK_N), NUM_SPLITS) * BLOCK_N


@triton.jit
def _row_lo(lo_ptr, b, seq_len, chunk, CASC: tl.constexpr, CHUNKED: tl.constexpr):
    """The first position of a one-token row that its splits read (the decode kernel and the
    reduce partition ``[lo, seq_len)`` alike): ``CASC``, the row's ``kv_lo`` (the positions before
    it were the cascade kernel's); ``CHUNKED``, the start of the chunk of the row's token at
    ``seq_len - 1`` (it sees nothing before); else 0."""
    tl.static_assert(not (CASC and CHUNKED), "a cascade plan is not for chunked attention")
    lo = 0
    if CASC:
        lo = tl.load(lo_ptr + b)
    if CHUNKED:
        lo = ((seq_len - 1) // chunk) * chunk
    return lo


@triton.jit(do_not_specialize=["s_bt", "NUM_SPLITS", "chunk"])
def _decode_kernel(q_ptr, kc_ptr, vc_ptr, out_ptr, po_ptr, plse_ptr, qsl_ptr, sl_ptr, bt_ptr, lo_ptr, cpo_ptr, cplse_ptr,
                   s_qn, s_qh, s_on, s_oh, s_kp, s_kb, s_kh, s_vp, s_vb, s_vh, s_bt, qk_scale, NUM_SPLITS, chunk,
                   CASC: tl.constexpr, CHUNKED: tl.constexpr, HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                   SINGLE: tl.constexpr, DOT_PREC: tl.constexpr, ASM_V: tl.constexpr, CS: tl.constexpr,
                   PDL: tl.constexpr):
    pdl_entry(PDL)
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    seq_len = tl.load(sl_ptr + b)
    # CASC: the row's first kv_lo positions were the cascade kernel's; CHUNKED: they lie before the
    # row's chunk. The splits partition the rest. Compile-time switches: as a runtime flag the
    # cascade's dead merge cost plain steps 3 % (H200), and the chunk size, a runtime int, costs
    # an unchunked model nothing.
    kv_lo = _row_lo(lo_ptr, b, seq_len, chunk, CASC, CHUNKED)
    part = _partition(seq_len - kv_lo, NUM_SPLITS, BLOCK_N)
    lo = kv_lo + split * part
    if (q_len == 1) & (lo < seq_len):  # longer queries of a mixed step are the prefill kernel's
        hi = tl.minimum(seq_len, lo + part)
        g = tl.arange(0, BLOCK_G)
        head = kvh * G + g
        gm = g < G
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        tok = q_start.to(tl.int64)
        q = tl.load(q_ptr + tok * s_qn + head[:, None] * s_qh + d[None, :], mask=gm[:, None] & dm[None, :],
                    other=0.0)
        q = _dot_dtype_q(q, kc_ptr)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            jm = j < hi
            koff = _kv_tile_offsets(bt_ptr, b, s_bt, j, jm, kvh, s_kp, s_kb, s_kh, BLOCK_SIZE)
            voff = _kv_tile_offsets(bt_ptr, b, s_bt, j, jm, kvh, s_vp, s_vb, s_vh, BLOCK_SIZE)
            k = tl.load(kc_ptr + koff[None, :] + d[:, None], mask=jm[None, :] & dm[:, None], other=0.0).to(q.dtype)
            v = _widen_v(tl.load(vc_ptr + voff[:, None] + d[None, :], mask=jm[:, None] & dm[None, :], other=0.0), q, ASM_V)
            s = tl.dot(q, k, input_precision=DOT_PREC) * qk_scale
            s = tl.where(jm[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
            m_i = m_new
        o = acc / l_i[:, None]
        if SINGLE:
            if CASC:
                o = _merge_prefix(o, m_i + tl.log2(l_i), cpo_ptr, cplse_ptr, b * HQ + head, gm & ((g * 0 + kv_lo) > 0),
                                  d, dm, D, CS)
            tl.store(out_ptr + tok * s_on + head[:, None] * s_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=gm[:, None] & dm[None, :])
        else:
            row = (b * HQ + head) * NUM_SPLITS + split
            tl.store(po_ptr + row[:, None] * D + d[None, :], o, mask=gm[:, None] & dm[None, :])
            tl.store(plse_ptr + row, m_i + tl.log2(l_i), mask=gm)


_DECODE_LAUNCH = CachedLauncher(_decode_kernel, pdl=True)


@triton.jit(do_not_specialize=["s_bt"])
def _cascade_kernel(q_ptr, kc_ptr, vc_ptr, cpo_ptr, cplse_ptr, qsl_ptr, bt_ptr, tiles_ptr,
                    s_qn, s_qh, s_kp, s_kb, s_kh, s_vp, s_vb, s_vh, s_bt, qk_scale,
                    HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    CS: tl.constexpr, DOT_PREC: tl.constexpr, ASM_V: tl.constexpr, PDL: tl.constexpr):
    pdl_entry(PDL)
    base = tiles_ptr + tl.program_id(0).to(tl.int64) * (R + 2)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    plen = tl.load(base + 1)  # 0: an unused tile of the static grid
    if plen > 0:
        # the prefix in CS whole-tile partitions, one a program (an empty one writes weight 0)
        part = _partition(plen, CS, BLOCK_N)
        lo = split * part
        hi = tl.minimum(plen, lo + part)
        ref = tl.load(base).to(tl.int64)  # a row of the group: its table holds the shared pages
        rows = tl.arange(0, BLOCK_M)
        head = kvh * G + rows % G
        brow = tl.load(base + 2 + rows // G, mask=rows < R * G, other=-1)
        rm = brow >= 0
        brow = tl.where(rm, brow, 0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        tok = tl.load(qsl_ptr + brow, mask=rm, other=0).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * s_qn + head[:, None] * s_qh + d[None, :], mask=rm[:, None] & dm[None, :],
                    other=0.0)
        q = _dot_dtype_q(q, kc_ptr)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            jm = j < hi
            koff = _kv_tile_offsets(bt_ptr, ref, s_bt, j, jm, kvh, s_kp, s_kb, s_kh, BLOCK_SIZE)
            voff = _kv_tile_offsets(bt_ptr, ref, s_bt, j, jm, kvh, s_vp, s_vb, s_vh, BLOCK_SIZE)
            # the first tile has a position, so the running max is finite after it
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, kc_ptr, vc_ptr, koff, voff, j, jm, j, d, dm, qk_scale,
                                         False, DOT_PREC, ASM_V)
        crow = (brow * HQ + head) * CS + split
        some = l_i > 0
        o = acc / tl.where(some, l_i, 1.0)[:, None]
        tl.store(cpo_ptr + crow[:, None] * D + d[None, :], o, mask=rm[:, None] & dm[None, :])
        tl.store(cplse_ptr + crow, tl.where(some, m_i + tl.log2(l_i), float("-inf")), mask=rm)


_CASCADE_LAUNCH = CachedLauncher(_cascade_kernel, pdl=True)


@triton.jit(do_not_specialize=["NUM_SPLITS", "chunk"])
def _reduce_kernel(out_ptr, po_ptr, plse_ptr, qsl_ptr, sl_ptr, lo_ptr, cpo_ptr, cplse_ptr, s_on, s_oh,
                   NUM_SPLITS, chunk, CASC: tl.constexpr, CHUNKED: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, CS: tl.constexpr,
                   PDL: tl.constexpr):
    pdl_entry(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if q_len == 1:
        seq_len = tl.load(sl_ptr + b)
        kv_lo = _row_lo(lo_ptr, b, seq_len, chunk, CASC, CHUNKED)
        part = _partition(seq_len - kv_lo, NUM_SPLITS, BLOCK_N)
        n_active = (seq_len - kv_lo + part - 1) // part
        sp = tl.arange(0, BLOCK_S)
        sm = sp < n_active
        row = (b * HQ + h) * NUM_SPLITS + sp
        lse = tl.load(plse_ptr + row, mask=sm, other=float("-inf"))
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        o = tl.load(po_ptr + row[:, None] * D + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
        if CASC:  # the cascade prefix partials are CS more terms (weight 0 where the row has none)
            cs = tl.arange(0, CS)
            cm = (cs * 0 + kv_lo) > 0
            crow = (b * HQ + h) * CS + cs
            clse = tl.load(cplse_ptr + crow, mask=cm, other=float("-inf"))
            mx = tl.maximum(tl.max(lse, axis=0), tl.max(clse, axis=0))
            w = tl.where(sm, tl.exp2(lse - mx), 0.0)
            wc = tl.exp2(clse - mx)
            co = tl.load(cpo_ptr + crow[:, None] * D + d[None, :], mask=cm[:, None] & dm[None, :], other=0.0)
            res = ((tl.sum(o * w[:, None], axis=0) + tl.sum(co * wc[:, None], axis=0))
                   / (tl.sum(w, axis=0) + tl.sum(wc, axis=0)))
        else:
            w = tl.where(sm, tl.exp2(lse - tl.max(lse, axis=0)), 0.0)
            res = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
        tl.store(out_ptr + q_start.to(tl.int64) * s_on + h * s_oh + d, res.to(out_ptr.dtype.element_ty), mask=dm)


_REDUCE_LAUNCH = CachedLauncher(_reduce_kernel, pdl=True)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA device's compute capability; None elsewhere (the interpreter)."""
    if device.type != "cuda":
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


# The packed bfloat16 exp (``ex2.approx.ftz.bf16x2``) is an sm_90 instruction, and the 128-key
# tile it makes room for takes 192 KB of shared memory, more than an A100 has.
SM90 = (9, 0)


def long_keys(capability: tuple[int, int] | None, kv_fp8: bool, chunk: int) -> bool:
    """Whether the large prefill tile may take 128 keys (:func:`prefill_shape`): a 16-bit cache
    without chunked attention (where it was measured), on :data:`SM90` or newer. Interpreted
    (``capability`` None) it is taken, so the shape is tested."""
    return not kv_fp8 and chunk == 0 and (capability is None or capability >= SM90)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter runs: a few splits so the reduce path is exercised


def prefill_shape(n: int, g: int, hkv: int, wide: bool, block_d: int, sm_count: int,
                  long_keys: bool) -> tuple[int, int, int, int]:
    """The prefill kernel's launch shape for ``n`` query tokens: (BLOCK_M, BLOCK_N, warps, stages).
    ``long_keys``: the large tile may take 128 keys (:func:`long_keys`: a 16-bit cache without
    chunked attention, where it was measured, on sm_90 or newer; over an e4m3 cache or with
    chunks it spills more, 800 and 1,488 bytes a thread at triton 3.9 against 608, and has not
    been timed: 64 keys there).

    Head_dim 128 in 16 bits (ops/gpu/prefill_bench.py, docs/perf.md, H100): 256 query rows (64
    tokens x a GQA group of 4) over 128-key tiles, 8 warps, 2 stages, the probabilities packed
    (:func:`packed_exp`), ran a 32k prompt at 453-465 TFLOP/s causal (64-key tiles, 3 stages:
    426-433; 128 x 128: 373; torch's flash backend: 332-338, same runs) — while its programs
    fill the GPU. A chunk of a few hundred tokens deep in a long context has few query tiles, each a long
    walk over the keys: at 256 rows 64 programs for 132 SMs, so such chunks take 64-row tiles
    (4 warps, 3 stages), four times the programs. H200, 32k of context: 460 tokens 0.76 ms at
    64 rows against 1.33 ms at 256; 1,024 tokens (128 programs at 256 rows) 1.65 against 1.37 ms,
    hence the switch at three quarters of the SMs. The choice depends on ``n`` and the device
    alone, so a mixed-step graph's bucket fixes it; the runner's warm-up at its smallest and
    largest buckets compiles both."""
    if wide:
        return 32, 32, 4 if block_d <= 64 else 8, 2
    if block_d != 128:
        return 128, 64, 4 if block_d <= 64 else 8, 3
    if 4 * triton.cdiv(n, max(1, 256 // g)) * hkv >= 3 * sm_count:
        return (256, 128, 8, 2) if long_keys else (256, 64, 8, 3)
    return 64, 64, 4, 3


def packed_exp(block_m: int, block_n: int, dtype: torch.dtype, capability: tuple[int, int] | None) -> bool:
    """Whether a prefill tile computes its probabilities two at a time in 16 bits
    (:func:`_exp2_packed`): the 256 x 128 tile's float32 scores and probabilities spilled
    (292 TFLOP/s at 32k on the H100), and with packed ones it is the fastest shape (453-465,
    against 426-433 for 256 x 64 tiles, packed or not; torch's flash backend 332-338, same
    runs). Smaller tiles gain nothing (64 rows: 334 against 362 at a 512-token chunk at 32k).
    Compiled for :data:`SM90` or newer only (``capability`` None, the interpreter: never), whatever
    tile a benchmark's ``config`` asks."""
    return (block_m * block_n >= 256 * 128 and dtype in (torch.bfloat16, torch.float16)
            and capability is not None and capability >= SM90)


def decode_splits(batch: int, hkv: int, max_seq_len: int, block_n: int, sm_count: int) -> int:
    """The decode grid's split count: enough programs to fill the chip twice over, at most one a
    KV tile of ``max_seq_len``. Each row spreads its own context over all of them
    (:func:`_partition`), so a long row beside short ones is not walked by one program."""
    tiles = max(1, triton.cdiv(max_seq_len, block_n))
    want = max(1, triton.cdiv(2 * sm_count, batch * hkv))
    return min(want, tiles, 64)


def _decode_block_n(head_dim: int, dtype: torch.dtype) -> int:
    """The decode kernel's KV tile: float32 tiles take twice the registers, so half as many
    (fp32 KV is a test path, not served)."""
    return 64 if head_dim <= 128 and dtype != torch.float32 else 32


def decode_forms(batches: list[int], head_dim: int, dtype: torch.dtype, num_kv_heads: int, max_seq_len: int,
                 device: torch.device) -> list[int]:
    """One batch size of ``batches`` per compiled form of the decode path (unsplit, or split with
    its reduce's ``BLOCK_S``), largest first: running those eagerly compiles every kernel a graph
    of any of ``batches`` launches (a graph's decode runs with ``max_seq_len``)."""
    block_n = _decode_block_n(head_dim, dtype)
    forms: dict[int, int] = {}
    for b in sorted(batches, reverse=True):
        splits = decode_splits(b, num_kv_heads, max_seq_len, block_n, _sm_count(device))
        forms.setdefault(0 if splits == 1 else triton.next_power_of_2(splits), b)
    return sorted(forms.values(), reverse=True)


# The shared prefix of a cascade tile is read in this many partitions, one program each: a
# group's few tiles × KV heads alone are too few programs for the chip, and each would walk the
# whole prefix in sequence (a first H200 run with one program a tile gained nothing on decode
# steps: the cascade kernel's latency ate the reads it saved).
CASCADE_SPLITS = 8


def cascade_block_m(rows_per_tile: int, g: int) -> int:
    """The cascade kernel's query-tile height for tiles of ``rows_per_tile`` rows of G heads."""
    return max(16, triton.next_power_of_2(rows_per_tile * g))


def _cascade(q, k_cache, v_cache, query_start_loc, block_tables, tiles, common, b, hq, hkv, g, d, block_d,
             dot_prec, asm_v) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix partials of a cascade plan's rows: ([B * Hq * CASCADE_SPLITS, D] outputs, [B * Hq *
    CASCADE_SPLITS] log2-sum-exps), float32; rows outside the plan are left unwritten (the
    decode kernel never reads them)."""
    cpo = torch.empty((b * hq * CASCADE_SPLITS, d), dtype=torch.float32, device=q.device)
    cplse = torch.empty((b * hq * CASCADE_SPLITS,), dtype=torch.float32, device=q.device)
    r = tiles.shape[1] - 2
    wide = q.dtype == torch.float32 or d > 128
    block_m = cascade_block_m(r, g)
    _CASCADE_LAUNCH.launch((tiles.shape[0], hkv, CASCADE_SPLITS),
        q, k_cache, v_cache, cpo, cplse, query_start_loc, block_tables, tiles,
        common[0], common[1], *common[4:10], common[10], common[11],
        HQ=hq, G=g, D=d, BLOCK_D=block_d, BLOCK_SIZE=k_cache.shape[1], R=r, BLOCK_M=block_m,
        BLOCK_N=32 if wide or block_m > 64 else 64, CS=CASCADE_SPLITS, DOT_PREC=dot_prec, ASM_V=asm_v,
        num_warps=4 if block_m <= 64 else 8, num_stages=2,
    )
    return cpo, cplse


def _decode_rows(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, common, cfg, num_splits,
                 max_seq_len, b, hq, hkv, g, d, block_d, dot_prec, asm_v, cascade, chunk) -> None:
    """Flash-decoding of every one-token query (all rows of a decode step; the decode rows of a
    mixed step, whose other sequences the kernels skip). ``cascade``: (tiles, kv_lo) of a plan,
    or None; ``chunk``: the chunk size of chunked attention, or 0."""
    block_n = cfg.get("block_n", _decode_block_n(d, q.dtype))
    block_g = max(16, triton.next_power_of_2(g))
    if num_splits is None:
        splits = decode_splits(b, hkv, max_seq_len, block_n, _sm_count(q.device))
    else:
        splits = max(1, min(num_splits, triton.cdiv(max_seq_len, block_n)))
    if cascade is not None:
        tiles, kv_lo = cascade
        cpo, cplse = _cascade(q, k_cache, v_cache, query_start_loc, block_tables, tiles, common, b, hq, hkv, g, d,
                              block_d, dot_prec, asm_v)
    else:  # never read (CASC=False)
        kv_lo, cpo, cplse = seq_lens, out, out
    po, plse = cpo, cplse  # unused when there is one split
    if splits > 1:
        po = torch.empty((b * hq * splits, d), dtype=torch.float32, device=q.device)
        plse = torch.empty((b * hq * splits,), dtype=torch.float32, device=q.device)
    casc = cascade is not None
    _DECODE_LAUNCH.launch((b, hkv, splits),
        q, k_cache, v_cache, out, po, plse, query_start_loc, seq_lens, block_tables, kv_lo, cpo, cplse, *common,
        splits, chunk, CASC=casc, CHUNKED=chunk > 0,
        HQ=hq, G=g, D=d, BLOCK_D=block_d, BLOCK_SIZE=k_cache.shape[1], BLOCK_G=block_g, BLOCK_N=block_n,
        SINGLE=splits == 1, DOT_PREC=dot_prec, ASM_V=asm_v, CS=CASCADE_SPLITS, num_warps=cfg.get("num_warps", 4),
        # two stages: ahead of three at every batch from 64 rows, bf16 (5 %) and e4m3 (18 %) caches
        # alike (H200, docs/perf.md: the attention sweep row)
        num_stages=cfg.get("num_stages", 2),
    )
    if splits > 1:
        _REDUCE_LAUNCH.launch((b, hq), out, po, plse, query_start_loc, seq_lens, kv_lo, cpo, cplse,
                                out.stride(0), out.stride(1), splits, chunk, CASC=casc, CHUNKED=chunk > 0, HQ=hq, D=d,
                                BLOCK_D=block_d, BLOCK_N=block_n,
                                BLOCK_S=triton.next_power_of_2(splits), CS=CASCADE_SPLITS, num_warps=4)


def paged_attention_triton(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                           max_query_len, max_seq_len, num_splits: int | None = None, out=None,
                           config: dict | None = None, cascade: tuple[torch.Tensor, torch.Tensor] | None = None,
                           chunk: int = 0):
    """See attention.paged_attention (which validates; a cascade plan with ``chunk`` > 0 fails to
    compile here). For benchmarks and tests: ``num_splits`` overrides the decode split heuristic,
    ``config`` the launch shape (``block_n``, ``num_warps``, ``num_stages``) and ``out`` supplies a
    (poisoned) output buffer."""
    cfg = config or {}
    n, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    b = seq_lens.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    block_d = triton.next_power_of_2(d)
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    asm_v = k_cache.dtype == FP8 and q.dtype in (torch.bfloat16, torch.float16) and _DECODE_LAUNCH.compiled
    qk_scale = float(scale) * LOG2E
    common = (q.stride(0), q.stride(1), out.stride(0), out.stride(1),
              k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
              v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), qk_scale)
    # ``config`` tunes the kernel a benchmark times: the decode kernel's on decode steps only
    _decode_rows(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, common,
                 cfg if max_query_len <= 1 else {}, num_splits, max_seq_len, b, hq, hkv, g, d, block_d, dot_prec, asm_v,
                 cascade, chunk)
    if max_query_len <= 1:
        return out
    cap = device_capability(q.device)
    shape = prefill_shape(n, g, hkv, q.dtype == torch.float32 or d > 128, block_d, _sm_count(q.device),
                          long_keys(cap, k_cache.dtype == FP8, chunk))
    block_m = max(cfg.get("block_m", shape[0]), triton.next_power_of_2(g))
    block_n = cfg.get("block_n", shape[1])
    tpt = block_m // g
    # one program per (KV head, query tile) that has work, plus at most one idle per sequence; the
    # one-token rows of a mixed step were the decode kernel's (MIN_Q=2 skips them here): a decode
    # row in a prefill tile would use G of its BLOCK_M rows and read its context unsplit
    grid = (hkv, triton.cdiv(n, tpt) + b)
    _PREFILL_LAUNCH.launch(grid,
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, *common, b, chunk, CHUNKED=chunk > 0,
        G=g, D=d, BLOCK_D=block_d, BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_N=block_n, TPT=tpt,
        DOT_PREC=dot_prec, MIN_Q=2, ASM_V=asm_v,
        PACKED_EXP=packed_exp(block_m, block_n, q.dtype, cap) and _PREFILL_LAUNCH.compiled,  # inline assembly
        num_warps=cfg.get("num_warps", shape[2]),
        num_stages=cfg.get("num_stages", shape[3]),
    )
    return out

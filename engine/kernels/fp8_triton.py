"""Triton FP8 kernels: per-row quantization and the few-rows scaled matmul.

- ``_quantize_rows_kernel``: one program per row, the whole row in registers: amax, scale, e4m3.
- ``_small_m_kernel``: ``y = a_scale * w_scale * (a_q @ w_q.T)`` for at most ``fp8.triton_rows`` rows
  (in one tile of 16 or 64 rows, padded). A decode step of a few sequences only has to read
  the weights once, so the grid is over output channels (BLOCK_N each) and, for the long-K
  linears, over K splits (``SPLIT_K`` > 1 adds float32 partials atomically into a zeroed buffer,
  cast after). cuBLASLt's row-wise FP8 GEMM at one row ran no faster than bf16 on the H200
  (4.05 vs 4.03 ms for an 8B's linears), a quarter of the weight-read rate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._launch import CachedLauncher, pdl_entry
from engine.kernels.fp8_format import E4M3_MAX, FP8, MIN_SCALE, Fp8Rows

# The scheme's constants as kernels may read them (a jitted function sees constexpr globals only).
E4M3_MAX_C = tl.constexpr(E4M3_MAX)
MIN_SCALE_C = tl.constexpr(MIN_SCALE)


@triton.jit
def f16_dot_operand(x):
    """``x`` in the dtype of a dot against widened e4m3 values: bfloat16 goes to float16, because
    e4m3 widens to float16 in one instruction a pair and to bfloat16 only by way of float32 (with
    bf16 dots the e4m3 decode attention spent its time converting: docs/perf.md, the attention
    sweep row). A bfloat16 value loses nothing in float16's normal range (float16 has the more
    mantissa); past ±65504 it is clamped (activations that large do not occur in practice), below
    2^-14 it keeps fewer bits. Other dtypes stay as they are."""
    if x.dtype == tl.bfloat16:
        x = tl.clamp(x.to(tl.float32), -65504.0, 65504.0, propagate_nan=tl.PropagateNan.ALL).to(tl.float16)
    return x


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, s_x, s_q, K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_entry(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / E4M3_MAX_C, MIN_SCALE_C)
    q = tl.clamp(x / scale, -E4M3_MAX_C, E4M3_MAX_C)
    tl.store(q_ptr + row * s_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


_QUANTIZE_LAUNCH = CachedLauncher(_quantize_rows_kernel, pdl=True)


def row_warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 8192 else 16


def quantize_rows_triton(x: torch.Tensor, out: Fp8Rows | None = None) -> Fp8Rows:
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = Fp8Rows(torch.empty((m, k), dtype=FP8, device=x.device),
                      torch.empty((m, 1), dtype=torch.float32, device=x.device))
    q, s = out
    block = triton.next_power_of_2(k)
    _QUANTIZE_LAUNCH.launch((m,), x, q, s, x.stride(0), q.stride(0), K=k, BLOCK=block, num_warps=row_warps(block))
    return out


@triton.jit(do_not_specialize=["M"])
def _small_m_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, s_a, s_w, s_y,
                    HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_PER_SPLIT: tl.constexpr, PDL: tl.constexpr):
    pdl_entry(PDL)
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    rm = rows < M
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = split * K_PER_SPLIT
    for k0 in range(k_lo, k_lo + K_PER_SPLIT, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < K
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * s_a + k[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        w = tl.load(w_ptr + n[None, :].to(tl.int64) * s_w + k[:, None], mask=nm[None, :] & km[:, None], other=0.0)
        acc += tl.dot(a, w)
    a_s = tl.load(as_ptr + rows, mask=rm, other=0.0)
    w_s = tl.load(ws_ptr + n, mask=nm, other=0.0)
    y = acc * a_s[:, None] * w_s[None, :]
    if HAS_BIAS:
        if split == 0:
            y += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rows[:, None].to(tl.int64) * s_y + n[None, :]
    if ATOMIC:
        tl.atomic_add(out, y, mask=rm[:, None] & nm[None, :], sem="relaxed")
    else:
        tl.store(out, y.to(y_ptr.dtype.element_ty), mask=rm[:, None] & nm[None, :])


_SMALL_M_LAUNCH = CachedLauncher(_small_m_kernel, pdl=True)


def small_m_config(n: int, k: int, m: int = 1) -> dict:
    """Launch shape of the few-rows kernel for ``m`` rows of an [N, K] weight: the best of
    ops/gpu/fp8_bench.py's sweeps on the H200 for each of an 8B's four projections (docs/perf.md).
    Up to 16 rows (one 16-row tile; ``--one-row``, weights that do not fit L2): two warps and a
    deep pipeline — many small programs keep more loads in flight than a few wide ones; 16
    channels a program where N is 4096 (o, down: twice the programs of 32), 32 elsewhere;
    512-wide K steps for the long-K down projection, 256 elsewhere; 3 stages for the widest
    weight, 5-6 for the others. 17-64 rows (one 64-row tile): 64 channels (32 where N is 4096),
    256-wide K steps (128 for the widest), 4 stages (3). 65-128 rows (N = 4096 only, see
    ``fp8.triton_rows``): 64-row tiles of 64 channels, 256-wide K steps, 4 stages."""
    wide = n >= 16384
    if m <= 16:
        narrow = n <= 4096
        return {"block_m": 16, "block_n": 16 if narrow else 32, "block_k": 512 if k > 8192 else 256, "split_k": 1,
                "num_warps": 2, "num_stages": 3 if wide else 5 if narrow and k <= 8192 else 6}
    if m > 64:
        return {"block_m": 64, "block_n": 64, "block_k": 256, "split_k": 1, "num_warps": 4, "num_stages": 4}
    return {"block_m": 64, "block_n": 32 if n <= 4096 else 64, "block_k": 128 if wide else 256, "split_k": 1,
            "num_warps": 4, "num_stages": 3 if wide else 4}


def fp8_linear_small_m(a: Fp8Rows, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                       out_dtype: torch.dtype, config: dict | None = None) -> torch.Tensor:
    """See fp8.fp8_linear (the engine calls it for at most ``fp8.triton_rows`` rows). ``config`` overrides
    :func:`small_m_config` (benchmarks)."""
    m, k = a.q.shape
    n = w_q.shape[0]
    cfg = config or small_m_config(n, k, m)
    block_k = cfg["block_k"]
    split_k = max(1, min(cfg["split_k"], triton.cdiv(k, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    atomic = split_k > 1
    y = (torch.zeros((m, n), dtype=torch.float32, device=a.q.device) if atomic
         else torch.empty((m, n), dtype=out_dtype, device=a.q.device))
    q = a.q if a.q.stride(1) == 1 else a.q.contiguous()
    block_m = cfg.get("block_m", 16)
    _SMALL_M_LAUNCH.launch((triton.cdiv(n, cfg["block_n"]), split_k, triton.cdiv(m, block_m)),
        q, a.scale, w_q, w_scale, bias if bias is not None else w_scale, y, m, n, k,
        q.stride(0), w_q.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, ATOMIC=atomic, BLOCK_M=block_m, BLOCK_N=cfg["block_n"], BLOCK_K=block_k,
        K_PER_SPLIT=k_per_split, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return y.to(out_dtype) if atomic else y

"""Triton SiLU-and-mul: grid (rows, column blocks), float32 inside. The quantizing variant (FP8
models) takes a whole row per program: its scale is the row's amax."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._launch import CachedLauncher, pdl_entry
from engine.kernels.fp8_format import FP8, Fp8Rows
from engine.kernels.fp8_triton import E4M3_MAX_C, MIN_SCALE_C, row_warps


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, s_x, s_o, I: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_entry(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * s_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * s_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


_SILU_MUL_LAUNCH = CachedLauncher(_silu_mul_kernel, pdl=True)


def silu_and_mul_triton(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    n, two_i = x.shape
    i = two_i // 2
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty((n, i), dtype=x.dtype, device=x.device)
    block = min(2048, triton.next_power_of_2(i))
    _SILU_MUL_LAUNCH.launch((n, triton.cdiv(i, block)), x, out, x.stride(0), out.stride(0), I=i, BLOCK=block,
                                                 num_warps=4 if block >= 512 else 1)
    return out


@triton.jit
def _silu_mul_quant_kernel(x_ptr, q_ptr, s_ptr, s_x, s_q, I: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_entry(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < I
    gr = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0)
    g = gr.to(tl.float32)
    u = tl.load(x_ptr + row * s_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    y = (g / (1.0 + tl.exp(-g)) * u).to(gr.dtype).to(tl.float32)  # as the bf16 model rounds it
    scale = tl.maximum(tl.max(tl.abs(y), axis=0) / E4M3_MAX_C, MIN_SCALE_C)
    q = tl.clamp(y / scale, -E4M3_MAX_C, E4M3_MAX_C)
    tl.store(q_ptr + row * s_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


_SILU_MUL_QUANT_LAUNCH = CachedLauncher(_silu_mul_quant_kernel, pdl=True)


def silu_and_mul_quant_triton(x: torch.Tensor) -> Fp8Rows:
    n, two_i = x.shape
    i = two_i // 2
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((n, i), dtype=FP8, device=x.device)
    s = torch.empty((n, 1), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(i)
    _SILU_MUL_QUANT_LAUNCH.launch((n,), x, q, s, x.stride(0), q.stride(0), I=i, BLOCK=block,
                                  num_warps=row_warps(block))
    return Fp8Rows(q, s)

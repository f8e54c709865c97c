"""Triton RMSNorm / fused residual-add RMSNorm: one program per row, the whole row in registers.

With ``QUANT`` the normalised row leaves as e4m3 with its dynamic per-row scale (engine.kernels.fp8):
the FP8 linear after the norm reads one byte a channel, and no separate quantization pass runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._launch import CachedLauncher, pdl_entry
from engine.kernels.fp8_format import FP8, Fp8Rows
from engine.kernels.fp8_triton import E4M3_MAX_C, MIN_SCALE_C


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr, s_x, s_r, s_o, s_ro, eps,
                     H: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr):
    pdl_entry(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + row * s_r + cols, mask=mask, other=0.0)
        # round the sum to the storage dtype first: that is the residual the model carries on
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * s_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / H
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = xf * (1.0 / tl.sqrt(var + eps)) * w
    if QUANT:
        # the bf16 model rounds y to bf16 before its linear: so does this, then quantizes
        y = y.to(x.dtype).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(y), axis=0) / E4M3_MAX_C, MIN_SCALE_C)
        y = tl.clamp(y / scale, -E4M3_MAX_C, E4M3_MAX_C)
        tl.store(scale_ptr + row, scale)
    tl.store(out_ptr + row * s_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


_RMS_NORM_LAUNCH = CachedLauncher(_rms_norm_kernel, pdl=True)


def rms_norm_triton(x, residual, w, eps, out=None, res_out=None, quant: bool = False):
    """Returns (out, new_residual or None); tests may pass (poisoned) output buffers. ``quant``:
    ``out`` is :class:`Fp8Rows`."""
    n, h = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    w = w.contiguous()
    if out is None:
        out = torch.empty((n, h), dtype=FP8 if quant else x.dtype, device=x.device)
    scale = torch.empty((n, 1), dtype=torch.float32, device=x.device) if quant else w
    if res_out is None:
        res_out = torch.empty((n, h), dtype=x.dtype, device=x.device) if residual is not None else out
    block = triton.next_power_of_2(h)
    warps = 1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 8192 else 16
    _RMS_NORM_LAUNCH.launch((n,),
        x, residual if residual is not None else x, w, out, res_out, scale,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), res_out.stride(0),
        float(eps), H=h, BLOCK=block, HAS_RES=residual is not None, QUANT=quant, num_warps=warps,
    )
    return (Fp8Rows(out, scale) if quant else out), (res_out if residual is not None else None)

"""RMSNorm and fused residual-add + RMSNorm, computed in float32.

``fused_add_rms_norm`` rounds ``x + residual`` to the input dtype first (the new residual, as a
bf16 model carries it) and normalises that rounded value, so ``out`` is consistent with the
residual the next layer adds to. ``quant=True`` (an FP8 model): the normalised rows, rounded to
x.dtype as always, leave quantized per row (:class:`engine.kernels.fp8_format.Fp8Rows`).
"""

from __future__ import annotations

import torch

from engine.kernels._dispatch import check, use_triton
from engine.kernels.fp8 import quantize_rows_ref


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    var = xf.pow(2).mean(dim=-1, keepdim=True)
    return (xf * torch.rsqrt(var + eps) * w.float()).to(x.dtype)


def fused_add_rms_norm_ref(x, residual, w, eps):
    new_res = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(new_res, w, eps), new_res


def _validate(x, w) -> None:
    check(x.dim() == 2, f"x must be [N, H], got {tuple(x.shape)}")
    check(w.dim() == 1 and w.shape[0] == x.shape[1], f"w must be [{x.shape[1]}], got {tuple(w.shape)}")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, quant: bool = False):
    """out[N,H] = x / rms(x) * w, float32 inside, x.dtype out (Fp8Rows with ``quant``)."""
    _validate(x, w)
    if x.shape[0] > 0 and use_triton(x, w):
        from engine.kernels.norm_triton import rms_norm_triton

        return rms_norm_triton(x, None, w, eps, quant=quant)[0]
    out = rms_norm_ref(x, w, eps)
    return quantize_rows_ref(out) if quant else out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float, quant: bool = False):
    """Return (rms_norm(x + residual), x + residual); both new tensors of x.dtype (the first
    Fp8Rows with ``quant``)."""
    _validate(x, w)
    check(residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x in shape and dtype")
    if x.shape[0] > 0 and use_triton(x, residual, w):
        from engine.kernels.norm_triton import rms_norm_triton

        return rms_norm_triton(x, residual, w, eps, quant=quant)
    out, res = fused_add_rms_norm_ref(x, residual, w, eps)
    return (quantize_rows_ref(out) if quant else out), res

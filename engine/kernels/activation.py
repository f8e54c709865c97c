"""SiLU-and-mul for gated MLPs: out = silu(gate) * up with x = [gate | up] along the last dim."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels._dispatch import check, use_triton
from engine.kernels.fp8 import quantize_rows_ref


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    i = x.shape[-1] // 2
    xf = x.float()
    return (F.silu(xf[:, :i]) * xf[:, i:]).to(x.dtype)


def silu_and_mul(x: torch.Tensor, quant: bool = False):
    """x[N, 2I] -> [N, I], float32 inside; ``quant``: rounded to x.dtype, then quantized per row
    (:class:`engine.kernels.fp8_format.Fp8Rows`, the input of an FP8 down projection)."""
    check(x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be [N, 2I], got {tuple(x.shape)}")
    if x.shape[0] > 0 and use_triton(x):
        from engine.kernels.activation_triton import silu_and_mul_quant_triton, silu_and_mul_triton

        return silu_and_mul_quant_triton(x) if quant else silu_and_mul_triton(x)
    out = silu_and_mul_ref(x)
    return quantize_rows_ref(out) if quant else out

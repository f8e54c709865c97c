"""FP8 (e4m3) weights and activations: quantization and the scaled matmul.

The scheme (docs/kernels.md, "FP8"): a weight ``[N, K]`` is stored as e4m3 with one float32 scale
per output channel (row), ``w ≈ q * scale[:, None]``; an activation ``[M, K]`` is quantized per
token (row), dynamically, by the kernel that produces it (the fused add-RMSNorm and SiLU-mul emit
:class:`Fp8Rows` instead of bf16; attention's output goes through :func:`quantize_rows`). A linear
is then ``y[m, n] = a_scale[m] * w_scale[n] * sum_k a_q[m, k] * w_q[n, k]``.

- On a GPU with FP8 tensor cores (compute capability >= 8.9) :func:`fp8_linear` is torch's
  row-wise scaled GEMM (``torch._scaled_mm``, fast accumulation) for prefill-sized batches and a
  Triton kernel up to :func:`triton_rows` rows (engine.kernels.fp8_triton: torch's FP8 GEMM at one
  row is no faster than bf16, while a decode step of that size only has to read the weights).
- Elsewhere (CPU) the reference dequantizes and matmuls in float32: the same quantized numbers,
  so CI checks the scheme's arithmetic without a GPU.

Scales are ``amax / 448`` (e4m3's largest finite value), clamped below so an all-zero row gets a
tiny positive scale (its codes are zero) instead of a division by zero.
"""

from __future__ import annotations

import torch

from engine.kernels._dispatch import check, use_triton
from engine.kernels.fp8_format import E4M3_MAX, FP8, MIN_SCALE, Fp8Rows


def triton_rows(n: int) -> int:
    """Up to how many rows a linear with ``n`` output channels runs on the Triton kernel; above,
    torch's GEMM. On the H200 (docs/perf.md, ``fp8_bench --medium``) the kernel was ahead at 32
    and 64 rows in all four of an 8B's projections (down 34 vs 42 us), and at 128 rows only where
    N is 4096 (o 15.8 vs 17.7 us, down 36.6 vs 42.5): the wider weights (qkv, gate-up) fill the
    GPU with torch's tiles by then, the narrow ones leave it half idle. From 256 rows torch's wins
    everywhere."""
    return 128 if n <= 4096 else 64


def fp8_supported(device: torch.device) -> tuple[bool, str]:
    """Whether FP8 weights can run on ``device`` with tensor cores, and why not when they cannot.
    CPU: yes (the reference path)."""
    if device.type == "cpu":
        return True, ""
    if device.type != "cuda":
        return False, f"FP8 is not supported on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        return False, (f"{name} (compute capability {major}.{minor}) has no FP8 tensor cores; "
                       "FP8 needs 8.9 or newer (Ada, Hopper)")
    return True, ""


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] (any float dtype) → (e4m3 [N, K], float32 scales [N]), one scale per row."""
    check(w.dim() == 2, f"weight must be [N, K], got {tuple(w.shape)}")
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / E4M3_MAX).clamp_min(MIN_SCALE)
    q = (wf / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q, scale


def quantize_rows_ref(x: torch.Tensor) -> Fp8Rows:
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp_min(MIN_SCALE)
    return Fp8Rows((xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8), scale)


def quantize_rows(x: torch.Tensor, out: Fp8Rows | None = None) -> Fp8Rows:
    """``x`` [M, K] → e4m3 with one dynamic scale per row (into ``out``'s tensors when given)."""
    check(x.dim() == 2, f"x must be [M, K], got {tuple(x.shape)}")
    if out is not None:
        check(out.q.shape == x.shape and out.q.dtype == FP8 and out.q.stride(1) == 1
              and out.scale.shape == (x.shape[0], 1) and out.scale.dtype == torch.float32,
              "out must be Fp8Rows of x's shape (e4m3, rows contiguous) and [M, 1] float32 scales")
    if x.shape[0] > 0 and use_triton(x):
        from engine.kernels.fp8_triton import quantize_rows_triton

        return quantize_rows_triton(x, out)
    rows = quantize_rows_ref(x)
    if out is None:
        return rows
    out.q.copy_(rows.q)
    out.scale.copy_(rows.scale)
    return out


def fp8_linear_ref(a: Fp8Rows, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                   out_dtype: torch.dtype) -> torch.Tensor:
    w = w_q.float() * w_scale.float()[:, None]
    y = a.dequantize() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def _validate(a: Fp8Rows, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    check(isinstance(a, Fp8Rows), "the input of an FP8 linear must be Fp8Rows")
    check(a.q.dim() == 2 and a.q.dtype == FP8, f"activations must be [M, K] e4m3, got {a.q.dtype} {tuple(a.q.shape)}")
    check(a.scale.shape == (a.q.shape[0], 1) and a.scale.dtype == torch.float32,
          f"activation scales must be [M, 1] float32, got {a.scale.dtype} {tuple(a.scale.shape)}")
    check(w_q.dim() == 2 and w_q.dtype == FP8 and w_q.shape[1] == a.q.shape[1],
          f"weight must be [N, {a.q.shape[1]}] e4m3, got {w_q.dtype} {tuple(w_q.shape)}")
    check(w_scale.shape == (w_q.shape[0],) and w_scale.dtype == torch.float32,
          f"weight scales must be [{w_q.shape[0]}] float32, got {w_scale.dtype} {tuple(w_scale.shape)}")
    check(bias is None or bias.shape == (w_q.shape[0],), "bias must be [N]")


def fp8_linear(a: Fp8Rows, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``y`` [M, N] in ``out_dtype`` = dequant(a) @ dequant(w).T (+ bias); see the module docstring."""
    _validate(a, w_q, w_scale, bias)
    m = a.q.shape[0]
    if m == 0:
        return torch.empty((0, w_q.shape[0]), dtype=out_dtype, device=w_q.device)
    if use_triton(a.q, w_q):
        if m <= triton_rows(w_q.shape[0]):
            from engine.kernels.fp8_triton import fp8_linear_small_m

            return fp8_linear_small_m(a, w_q, w_scale, bias, out_dtype)
        # Fast accumulation (the tensor cores' own sums, no periodic float32 promotion): 2-10 %
        # faster on the H200 at 256-4096 rows, relative error vs the float32 product 2.1e-3
        # instead of 1.7e-3 (3.3e-3 for the 14336-long down projection) — an order below e4m3's
        # own rounding of the inputs (docs/perf.md, fp8_bench --medium).
        y = torch._scaled_mm(a.q, w_q.t(), scale_a=a.scale, scale_b=w_scale.view(1, -1), out_dtype=out_dtype,
                             use_fast_accum=True)
        return y if bias is None else y + bias
    return fp8_linear_ref(a, w_q, w_scale, bias, out_dtype)

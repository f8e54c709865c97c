"""Triton grouped GEMM of the experts (engine/kernels/moe.py): grid (tiles of pairs, column
tiles); a tile's ``BLOCK_M`` pairs share one expert, so its rows gather the inputs (a token's
hidden row, or the pair's own row) and multiply them by that expert's weights, float32
accumulation, the routing weight applied before the store; padding slots and tiles past the last
used one store nothing. A sigmoid router's weights (``WEIGH_INPUT``) scale each gathered input
row instead, rounded to the inputs' dtype before the dot, as the reference model rounds its
scaled token. FP8 experts (``SCALED``): e4m3 weights widened tile by tile (to float16 under
bfloat16 inputs, which then run float16 dots: ``fp8_triton.f16_dot_operand``), each output
column times its expert's channel scale once after the sum. A gate-up stack runs ``GATED``:
each program multiplies its rows by the gate's and the up projection's columns of one tile at
once and stores SiLU(gate) · up, so the [pairs, 2I] product is never written and read back, and
the activation is not a kernel of its own. Launch sizes come from the tuned tables of
engine/kernels/moe_configs.py (defaults where none is kept)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.kernels._launch import CachedLauncher, pdl_entry
from engine.kernels.fp8_triton import f16_dot_operand
from engine.kernels.moe_configs import GemmShape, launch_shape, weights_name


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, ws_ptr, out_ptr, pair_ids_ptr, tile_expert_ptr, weights_ptr,
                         num_pairs, n_out, k_in, s_a, s_we, s_wn, s_o,
                         TOP_K: tl.constexpr, PER_PAIR: tl.constexpr, APPLY_WEIGHTS: tl.constexpr, SCALED: tl.constexpr,
                         WEIGH_INPUT: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl_entry(PDL)
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    slots = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pair_ids_ptr + slots).to(tl.int64)
    valid = pairs < num_pairs
    if PER_PAIR:
        rows = pairs
    else:
        rows = pairs // TOP_K
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if WEIGH_INPUT:
        rw = tl.load(weights_ptr + pairs, mask=valid, other=0.0)
    w_base = w_ptr + expert.to(tl.int64) * s_we
    for k0 in range(0, k_in, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_in
        a = tl.load(a_ptr + rows[:, None] * s_a + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        if WEIGH_INPUT:
            a = (a.to(tl.float32) * rw[:, None]).to(a_ptr.dtype.element_ty)
        if SCALED:
            a = f16_dot_operand(a)
        w_ptrs = w_base + cols[None, :] * s_wn + ks[:, None]
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if SCALED:
            w = w.to(a.dtype)
        acc += tl.dot(a, w)
        if GATED:  # the up projection's rows sit n_out rows below the gate's
            wu = tl.load(w_ptrs + n_out * s_wn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if SCALED:
                wu = wu.to(a.dtype)
            up += tl.dot(a, wu)
    # FP8: the expert's scale of each output channel ([E, N] float32, contiguous; [E, 2 * n_out] gated)
    if GATED:
        ws_base = ws_ptr + expert.to(tl.int64) * (2 * n_out)
    else:
        ws_base = ws_ptr + expert.to(tl.int64) * n_out
    if SCALED:
        acc = acc * tl.load(ws_base + cols, mask=col_ok, other=0.0)[None, :]
    if GATED:
        if SCALED:
            up = up * tl.load(ws_base + n_out + cols, mask=col_ok, other=0.0)[None, :]
        # SiLU(gate) · up of the two products rounded to the inputs' dtype, as the unfused
        # product's stored rows are before the activation reads them
        g = acc.to(a_ptr.dtype.element_ty).to(tl.float32)
        acc = g / (1.0 + tl.exp(-g)) * up.to(a_ptr.dtype.element_ty).to(tl.float32)
    if APPLY_WEIGHTS:
        acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    tl.store(out_ptr + pairs[:, None] * s_o + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])


_GROUPED_GEMM_LAUNCH = CachedLauncher(_grouped_gemm_kernel, pdl=True)


@functools.lru_cache(maxsize=16)
def _gpu_name(device: torch.device) -> str:
    """The name the tuned tables are kept under (asked once per device, not per GEMM)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def grouped_gemm_triton(a: torch.Tensor, w: torch.Tensor, pair_ids: torch.Tensor, tile_expert: torch.Tensor,
                        weights: torch.Tensor, top_k: int, block_m: int, per_pair_input: bool,
                        weights_at: str, w_scale: torch.Tensor | None = None, gated: bool = False,
                        shape: GemmShape | None = None) -> torch.Tensor:
    """The grouped GEMM of engine/kernels/moe.py (its ``Routing``'s tensors passed one by one;
    ``weights_at``: one of moe.WEIGHTS); ``w_scale`` [E, N] float32 with e4m3 ``w``; ``gated``:
    ``w`` is a gate-up stack [E, 2I, K] and the output [pairs, I] is SiLU(gate) · up. ``shape``:
    a launch shape to use (the tuner's candidates), else the tuned table's for this step's
    token count."""
    if a.stride(1) != 1:
        a = a.contiguous()
    if w.stride(2) != 1:
        w = w.contiguous()
    num_pairs = weights.shape[0]
    n_out, k_in = w.shape[1], w.shape[2]
    if shape is None:
        shape = launch_shape(w.shape[0], n_out, k_in, weights_name(w.dtype), _gpu_name(a.device), num_pairs // top_k,
                             gated)
    if gated:
        n_out //= 2
    out = torch.empty((num_pairs, n_out), dtype=a.dtype, device=a.device)
    grid = (tile_expert.shape[0], triton.cdiv(n_out, shape.block_n))
    scaled = w_scale is not None
    if scaled and not w_scale.is_contiguous():
        w_scale = w_scale.contiguous()
    _GROUPED_GEMM_LAUNCH.launch(grid, a, w, w_scale if scaled else weights, out, pair_ids, tile_expert, weights,
                                num_pairs, n_out, k_in, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
                                TOP_K=top_k, PER_PAIR=per_pair_input, APPLY_WEIGHTS=weights_at == "output",
                                SCALED=scaled, WEIGH_INPUT=weights_at == "input", GATED=gated,
                                BLOCK_M=block_m, BLOCK_N=shape.block_n, BLOCK_K=shape.block_k,
                                num_warps=shape.num_warps, num_stages=shape.num_stages)
    return out

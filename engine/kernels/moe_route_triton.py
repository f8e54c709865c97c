"""Triton routing of a mixture-of-experts layer (engine/kernels/moe.py ``route``) in one kernel:
each program takes ``BLOCK_N`` tokens' logits over every expert, scores them (softmax, or the
raw logits for a sigmoid router), picks the ``top_k`` best by repeated arg-max over the experts
not chosen yet and writes their weights (float32) and experts. The torch formulation is five to
seven kernels a sparse layer (cast, softmax, top-k, the renormalising sum and division, or the
sigmoid and its rounding); at batch 1 a CUDA graph's node costs a few microseconds however
little it does, so at 48 sparse layers that was ~1 ms of a token's time spent on launches.

Selection is on the logits (float32), which orders the experts as their softmax does; two equal
logits go to the lower expert index (``torch.topk`` leaves ties unspecified). The weights are
computed as the torch formulation computes them: the softmax's probabilities, divided by their
sum over the k when renormalising; a sigmoid router's weight is its logit's sigmoid rounded to
the logits' dtype, as the reference model rounds it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._launch import CachedLauncher, pdl_entry


# the token count changes with every step's size: a new one must not compile a kernel while serving
@triton.jit(do_not_specialize=["n_tokens"])
def _route_kernel(logits_ptr, weights_ptr, experts_ptr, n_tokens, s_l,
                  E: tl.constexpr, TOP_K: tl.constexpr, SOFTMAX: tl.constexpr, RENORMALIZE: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl_entry(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_tokens
    e = tl.arange(0, BLOCK_E)
    # a row past the last reads the last row's logits (its results are not stored): no -inf rows
    src = tl.minimum(rows, n_tokens - 1).to(tl.int64)
    raw = tl.load(logits_ptr + src[:, None] * s_l + e[None, :], mask=(e < E)[None, :], other=-float("inf"))
    # a NaN logit ranks first, as torch.topk ranks it: the arg-max below must always find a lane
    # (a step's warm-up runs on whatever the buffers hold; an expert index past E would be a
    # write out of bounds in the alignment)
    xr = raw.to(tl.float32)
    x = tl.where(xr != xr, float("inf"), xr)
    if SOFTMAX:
        p = tl.exp(x - tl.max(x, axis=1)[:, None])
        p = p / tl.sum(p, axis=1)[:, None]
    kk = tl.arange(0, BLOCK_K)
    chosen = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int32)
    weight = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    free = tl.broadcast_to((e < E)[None, :], (BLOCK_N, BLOCK_E))  # not chosen yet: every expert, at first
    for j in tl.static_range(TOP_K):
        left = tl.where(free, x, -float("inf"))
        best = tl.max(left, axis=1)
        # the lowest free expert holding it (a row of fewer than k finite logits still gets k
        # different experts: a chosen lane is no longer free, whatever its value)
        idx = tl.min(tl.where(free & (left == best[:, None]), e[None, :], BLOCK_E), axis=1)
        hit = e[None, :] == idx[:, None]
        if SOFTMAX:
            w = tl.sum(tl.where(hit, p, 0.0), axis=1)
        else:  # of the logit itself: a NaN stays NaN, as torch's weight for it is
            w = tl.sigmoid(tl.sum(tl.where(hit, xr, 0.0), axis=1)).to(raw.dtype).to(tl.float32)
        free = free & (hit == 0)
        chosen = tl.where(kk[None, :] == j, idx[:, None], chosen)
        weight = tl.where(kk[None, :] == j, w[:, None], weight)
    if RENORMALIZE:
        weight = weight / tl.sum(weight, axis=1)[:, None]
    out = rows[:, None].to(tl.int64) * TOP_K + kk[None, :]
    ok = row_ok[:, None] & (kk < TOP_K)[None, :]
    tl.store(weights_ptr + out, weight, mask=ok)
    tl.store(experts_ptr + out, chosen.to(tl.int64), mask=ok)


_ROUTE_LAUNCH = CachedLauncher(_route_kernel, pdl=True)


def route_triton(router_logits: torch.Tensor, top_k: int, softmax: bool, renormalize: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, k] float32, experts [N, k] int64) as ``moe.route`` gives them."""
    n, e = router_logits.shape
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty((n, top_k), dtype=torch.float32, device=router_logits.device)
    experts = torch.empty((n, top_k), dtype=torch.int64, device=router_logits.device)
    block_e = triton.next_power_of_2(e)
    block_n = max(1, min(16, 4096 // block_e))  # a program's logits: at most 4,096 in registers
    _ROUTE_LAUNCH.launch((triton.cdiv(n, block_n),), router_logits, weights, experts, n, router_logits.stride(0),
                         E=e, TOP_K=top_k, SOFTMAX=softmax, RENORMALIZE=renormalize,
                         BLOCK_N=block_n, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k), num_warps=4)
    return weights, experts
